"""torch.export of a transformers causal LM with dynamic batch, sequence and kept positions."""
from __future__ import annotations

import torch


class LogitsModel(torch.nn.Module):
    """The signature we compile: token ids and positions in, logits of chosen positions out.

    `logit_positions` (transformers' logits_to_keep as an index tensor) lets prefill project only
    each sequence's last token onto the vocabulary instead of every prompt token.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, logit_positions):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logit_positions)
        return out.logits


def export_logits_model(model, max_seq: int = 1 << 16):
    """ExportedProgram of LogitsModel(model) with symbolic batch, seq and kept count."""
    wrapper = LogitsModel(model).eval()
    vocab = model.config.get_text_config().vocab_size
    # example sizes that are distinct and > 1, so export does not specialize or merge them
    b, s, k = 2, 5, 3
    ids = torch.randint(0, vocab, (b, s))
    pos = torch.arange(s)[None].expand(b, s).contiguous()
    keep = torch.tensor([1, 3, 4])
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    kept = torch.export.Dim("kept", min=1, max=max_seq)
    shapes = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq},
              "logit_positions": {0: kept}}
    with torch.no_grad():
        return torch.export.export(wrapper, (ids, pos, keep), dynamic_shapes=shapes, strict=False)
