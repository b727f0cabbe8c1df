"""torch.export of a transformers causal LM with dynamic batch, sequence and kept positions."""
from __future__ import annotations

import torch


def decoder_layers(model):
    """The model's decoder layers (the ModuleList with one entry per hidden layer), or None."""
    num = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and num and len(module) == num:
            return module
    return None


def forward_with_hidden_states(model, **kwargs):
    """model(**kwargs) -> (logits, hidden states, their names), the same way in the trace and
    in an eager reference run (tvm-llm verify), so both define the states alike.

    The states are: "embed" (what the first decoder layer receives), "layer i" (decoder layer
    i's output, for every layer) and "final_norm" (what the LM head receives; left out for a
    model without a final norm). transformers' own hidden_states give the first and the last;
    its list replaces the last layer's output by the normed one, so a hook takes that back.
    """
    layers = decoder_layers(model)
    last = []

    def hook(module, args, output):
        last.append(output[0] if isinstance(output, tuple) else output)

    handle = layers[-1].register_forward_hook(hook) if layers is not None else None
    try:
        out = model(**kwargs, output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    hs = list(out.hidden_states)
    n = len(hs) - 1  # layers whose output transformers lists (the last one normed)
    states, names = [hs[0]], ["embed"]
    states += hs[1:n]
    names += [f"layer {i}" for i in range(n - 1)]
    if last:
        states.append(last[-1])
        names.append(f"layer {n - 1}")
    if not last or hs[-1] is not last[-1]:
        states.append(hs[-1])
        names.append("final_norm" if last else f"layer {n - 1} (normed)")
    return out.logits, states, names


class LogitsModel(torch.nn.Module):
    """The signature we compile: token ids and positions in; logits of chosen positions and the
    hidden states of every position (stacked, float32: (states, batch, seq, hidden)) out.

    `logit_positions` (transformers' logits_to_keep as an index tensor) lets prefill project only
    each sequence's last token onto the vocabulary instead of every prompt token. prefill and
    decode return the logits alone, so the stacked states are dead code there; the
    `hidden_states` function (tvm-llm verify) keeps them.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, logit_positions):
        logits, states, _ = forward_with_hidden_states(
            self.model, input_ids=input_ids, position_ids=position_ids, use_cache=False,
            logits_to_keep=logit_positions)
        # float32: the importer may give a float16 model's residual stream float32 already
        return logits, torch.stack([s.float() for s in states])


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
