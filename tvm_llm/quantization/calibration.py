"""Calibration at build time: what a calibration text tells the quantizer about activations.

One float forward over a few windows of the calibration text records, for the input of every
linear of the decoder layers, per input channel: mean |x|, mean x^2, max |x|, and an evenly
spaced sample of input rows. Three uses:

* importance (imatrix-style): mean x^2 per input channel is the weight of each column's
  rounding error in the linear's expected output error, E||(W - Wq) x||^2 ~ sum_k E[x_k^2]
  ||W[:, k] - Wq[:, k]||^2 (diagonal approximation). It is handed to the format quantizer
  through QuantPlan.importance.
* activation-aware scaling (AWQ-style): for each group of linears that share an input
  (q|k|v, gate|up, o, down) a per-input-channel scale s = mean|x|^alpha (normalized) is
  searched over a small alpha grid to minimize || X W^T - Q_x(X / s) Q_w(W * s)^T ||^2 on the
  sampled rows (Q_w the build's weight rounding, Q_x the int8 activation rounding for W8A8 /
  W4A8, identity otherwise). alpha = 0 (no scaling) is in the grid, so the chosen scale never
  does worse on the sample. The inverse 1/s is folded into the op that produces the input,
  so the float model computes the same function:
      q|k|v   <- input_layernorm weight          gate|up <- post_attention_layernorm weight
      o_proj  <- v_proj rows (one scale per KV head dim, shared by the query heads of a group)
      down    <- up_proj rows (silu(gate) * up is linear in up)
* SmoothQuant-style migration for the int8-activation paths: the same search with a second
  family of candidates, s = max|x|^a / max|W col|^(1 - a), which moves activation outliers into
  the weights; the activation rounding is part of the objective, so the better family wins.

Everything is deterministic: fixed windows, fixed row sample, numpy in float64 where summed.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import UserError
from .formats import host_threads, one_torch_thread

DEFAULT_CALIBRATION = os.path.join(os.path.dirname(__file__), "calibration.txt")
ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # 0 = unscaled
# input rows kept per linear for the scale search: 256 rows and 512 chose the same scales on
# SmolLM2-135M (120 groups) and on 47 of llama-110m's 48 groups, at half the search's matmuls
SAMPLE_ROWS = 256
# output rows (weight rows) the scale search scores per linear: a scaling multiplies input
# channels, every weight row is rounded on its own, so evenly spaced rows estimate the whole
# matrix's output error; llama-1b's gate|up has 11264 rows, SmolLM2's 3072. 512 rows and 1024
# chose the same scales on SmolLM2-135M (120 groups); on llama-1b (random weights) 24 of 88
# groups moved to a neighbouring alpha, mean output-error ratio x0.893 vs x0.898, at 0.59x the
# search's CPU. 256 rows: half the search's matmuls and round trips again; SmolLM2-135M (32
# windows of Opticks): q4 the same mix and perplexity (32.9299), q8 32.8474 -> 32.8385
SEARCH_ROWS = 256
# weight rows the mix's Fisher estimate rounds per unit (drawn in proportion to their squared
# gradient, weighted so the sum estimates all rows': _fisher_rows): each row's rounding error is
# independent of the others', so a few hundred rows rank the units as all of them do
FISHER_ROWS = 256
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")


def read_calibration(path: str | None) -> str:
    path = path or DEFAULT_CALIBRATION
    if not os.path.isfile(path):
        raise UserError(f"{path}: calibration text not found; pass --calibration FILE")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise UserError(f"{path}: calibration text is empty; pass a text file with prose")
    return text


@dataclass
class InputStats:
    """Per-input-channel statistics of one linear's input over the calibration tokens."""
    mean_abs: np.ndarray
    mean_sq: np.ndarray
    max_abs: np.ndarray
    sample: np.ndarray  # (rows, K) float32, evenly spaced over all tokens
    tokens: int

    def scaled(self, s: np.ndarray) -> "InputStats":
        """The statistics of x / s (after a folded channel scaling)."""
        return InputStats(self.mean_abs / s, self.mean_sq / (s * s), self.max_abs / s,
                          (self.sample / s).astype(np.float32), self.tokens)


@dataclass
class Calibration:
    """Statistics per linear module name (e.g. "model.layers.3.self_attn.q_proj")."""
    stats: dict
    tokens: int
    out_grad_sq: dict = field(default_factory=dict)  # name -> (N,) mean squared loss gradient
    scales: dict = field(default_factory=dict)  # group label -> chosen scaling, for the report

    def importance(self) -> dict:
        """checkpoint weight name -> (K,) mean x^2 (what QuantPlan.importance takes)."""
        return {f"{name}.weight": st.mean_sq.astype(np.float32) for name, st in self.stats.items()}


def token_windows(model_dir: str, text: str, window: int, max_windows: int) -> list:
    from tokenizers import Tokenizer

    from ..perplexity import windows

    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids
    wins = windows(ids, window, max_windows)
    if not wins:
        raise UserError(f"the calibration text has {len(ids)} tokens, fewer than one window of "
                        f"{window}; pass a longer --calibration text")
    return wins  # window + 1 tokens: inputs w[:-1], next-token targets w[1:]


def _linears(model) -> dict:
    """module name -> nn.Linear for every linear (decoder layers and the LM head)."""
    import torch

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def collect(model, windows: list, sample_rows: int = SAMPLE_ROWS, gradients: bool = False,
            gradient_windows: int | None = None) -> Calibration:
    """Run the float model over `windows` (window + 1 token ids each) and record every linear's
    input statistics. Linears fed the same tensor (q|k|v, gate|up) share one record. With
    `gradients`, also the mean squared gradient of the summed next-token loss at each linear's
    output (one backward per window, over the first `gradient_windows` windows, None: all;
    no weight gradients are formed)."""
    import torch

    linears = _linears(model)
    acc: dict = {}
    grads: dict = {}
    alias: dict = {}  # linear name -> name of the linear whose record it shares
    last = {"x": None, "name": None}
    per_window = -(-sample_rows // len(windows))
    n_grad = len(windows) if gradient_windows is None else min(gradient_windows, len(windows))

    def hook(name):
        def fn(_mod, args):
            x0 = args[0]
            if x0 is last["x"]:
                alias[name] = last["name"]
                return
            last["x"], last["name"] = x0, name
            # float32 element-wise work, float64 sums (a float64 copy of every input cost
            # as much CPU as the forward itself)
            x = x0.detach().reshape(-1, x0.shape[-1]).float()
            ax = x.abs()
            a = acc.setdefault(name, [0.0, 0.0, torch.zeros(x.shape[-1], dtype=torch.float64), []])
            a[0] = a[0] + ax.sum(0, dtype=torch.float64)
            a[1] = a[1] + (x * x).sum(0, dtype=torch.float64)
            a[2] = torch.maximum(a[2], ax.amax(0).double())
            pick = torch.from_numpy(np.linspace(0, len(x) - 1, min(per_window, len(x))).round()
                                    .astype(np.int64))
            a[3].append(x[pick])
        return fn

    def grad_hook(name):
        def fn(_mod, _args, out):  # the output's gradient, by a hook on the output tensor
            if not out.requires_grad:
                return

            def on_grad(g):
                g = g.detach().reshape(-1, g.shape[-1]).float()
                grads[name] = grads.get(name, 0.0) + (g * g).sum(0, dtype=torch.float64)
            out.register_hook(on_grad)
        return fn

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    if gradients and n_grad:
        hooks += [m.register_forward_hook(grad_hook(n)) for n, m in linears.items()]
    requires = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        for i, w in enumerate(windows):
            last["x"] = None
            ids = torch.tensor([w[:-1]])
            if not gradients or i >= n_grad:
                with torch.no_grad():
                    model(ids)
                continue
            emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=emb).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum")
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
        for p, r in zip(model.parameters(), requires):
            p.requires_grad_(r)
    tokens = sum(len(w) - 1 for w in windows)
    stats = {}
    for name, (sa, sq, mx, rows) in acc.items():
        stats[name] = InputStats((sa / tokens).numpy(), (sq / tokens).numpy(), mx.numpy(),
                                 torch.cat(rows).numpy().astype(np.float32), tokens)
    for name, src in alias.items():
        stats[name] = stats[src]
    grad_tokens = sum(len(w) - 1 for w in windows[:n_grad])
    return Calibration(stats, tokens, {n: (g / grad_tokens).numpy() for n, g in grads.items()})


# ------------------------------------------------------------------------------ scale search

def _normalized(s: np.ndarray) -> np.ndarray:
    s = np.maximum(s, 1e-8)
    return s / np.sqrt(s.max() * s.min())


def _candidates(st: InputStats, weights: list, activations: str) -> list:
    """(label, s) candidate scalings: AWQ mean|x|^alpha, and for int8 activations also
    SmoothQuant max|x|^a / max|W|^(1-a)."""
    out = [(f"awq {a}", _normalized(st.mean_abs ** a) if a else np.ones_like(st.mean_abs))
           for a in ALPHAS]
    if activations == "int8":
        # max |W| per column from the column max and min: np.abs made a whole-matrix temporary
        # (llama-1b: 0.12 s per gate|up, its fresh pages) for what two reductions give
        wmax = np.max([np.maximum(w.max(axis=0), -w.min(axis=0)) for w in weights], axis=0)
        for a in ALPHAS[1:]:
            out.append((f"smooth {a}", _normalized(np.maximum(st.max_abs, 1e-8) ** a
                                                   / np.maximum(wmax, 1e-8) ** (1 - a))))
    return out


def search_scale(st: InputStats, weights: list, quantize, quantize_input=None,
                 activations: str = "float", tie=None):
    """(label, s, error, error at s = 1) minimizing the output error of the linears `weights`
    (each (N, K) float32) on the sampled rows, scored on at most SEARCH_ROWS evenly spaced
    rows of each weight. `quantize(w) -> w'` is the build's weight
    round trip, `quantize_input(x) -> x'` the activation round trip (or None).
    `tie(s) -> s'` projects a candidate onto scalings the producer can absorb.

    The candidates are scored one after another on one torch thread: apply_awq runs one
    search per core."""
    import torch

    X = st.sample.astype(np.float32)
    candidates = _candidates(st, weights, activations)  # SmoothQuant's max|W| over every row
    weights = [w[np.linspace(0, len(w) - 1, SEARCH_ROWS).astype(np.int64)]
               if len(w) > SEARCH_ROWS else w for w in weights]

    def matmul(x, w):  # torch's single-threaded sgemm (see one_torch_thread)
        x, w = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in (x, w))
        return x @ w.T

    def score(candidate):
        label, s = candidate
        if tie is not None:
            s = tie(s)
        s = s.astype(np.float32)
        xs = X / s
        if quantize_input is not None:
            xs = quantize_input(xs)
        err = 0.0
        for w, r in zip(weights, ref):
            d = (matmul(xs, quantize(w * s)) - r).double()
            err += float(torch.dot(d.view(-1), d.view(-1)))
        return label, s, err

    with one_torch_thread():
        ref = [matmul(X, w) for w in weights]
        scored = [score(c) for c in candidates]
    best = None
    base = None
    for label, s, err in scored:
        if label == "awq 0.0":
            base = err
        if best is None or err < best[2]:
            best = (label, s, err)
    return best + (base,)


def fast_round_trip(w: np.ndarray, fmt: str) -> np.ndarray:
    """Round-to-nearest stand-in of a format's round trip, for the searches that round every
    weight many times (the scale search, the mix's error estimate): the format's grid with
    plain min/max (or abs-max) scales per 32-block, without the format's scale search or its
    scale rounding. ~50x cheaper than formats.fake_quantize; the build itself always stores
    weights with the format's own quantizer. In torch, on the caller's torch threads: its
    reductions over the 32-blocks and its element-wise kernels took a third of numpy's time
    for the same IEEE operations (identical results: min/max, divisions, round half to even,
    float16 casts)."""
    import torch

    from .formats import GROUP, get_format

    f = get_format(fmt)
    N, K = w.shape
    g = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).view(N, K // GROUP, GROUP)
    if f.kind == "sym":
        lo, hi = f.qrange
        amax = g.abs().amax(dim=-1, keepdim=True)
        d = amax / (hi if lo == -hi else -lo)
        q = torch.clamp(torch.round(g / torch.where(d > 0, d, 1)), lo, hi)
        return (q * d).view(N, K).numpy()
    nmax = f.qrange[1]
    mn = g.amin(dim=-1, keepdim=True)
    if f.kind == "kquant":
        mn = torch.clamp(mn, max=0)
    d = (g.amax(dim=-1, keepdim=True) - mn) / nmax
    if f.kind == "kquant":  # the group scales and minimums on their 6-bit super-block grids
        from .formats import super_groups

        S, NG = super_groups(K), K // GROUP

        def six_bit(v):
            v = v.reshape(N, NG // S, S)
            sup = (v.amax(dim=2, keepdim=True) / 63).half().float()
            code = torch.clamp(torch.round(v / torch.where(sup > 0, sup, 1)), 0, 63)
            return (code * sup).reshape(N, NG, 1)

        d, mn = six_bit(d), -six_bit(-mn)
    q = torch.clamp(torch.round((g - mn) / torch.where(d > 0, d, 1)), 0, nmax)
    return (q * d + mn).view(N, K).numpy()


# ------------------------------------------------------------------------------ folding

def _layer_modules(model):
    """(layer index, attention module, mlp module, input norm, post-attention norm) per layer,
    for Llama-style decoders (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj)."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            raise UserError("activation-aware scaling supports Llama-style decoders (q/k/v/o_proj, "
                            "gate/up/down_proj); build without --calibration-method awq")
        yield i, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm


def _scale_inputs(linears, s):
    import torch

    t = torch.from_numpy(s.astype(np.float32))
    for lin in linears:
        lin.weight.data = (lin.weight.data.float() * t[None, :]).to(lin.weight.dtype)


def _scale_outputs(module, inv):
    """Divide the output channels of `module` (an RMSNorm weight or a linear's rows) by s."""
    import torch

    t = torch.from_numpy(inv.astype(np.float32))
    if module.weight.dim() == 1:
        module.weight.data = (module.weight.data.float() / t).to(module.weight.dtype)
    else:
        module.weight.data = (module.weight.data.float() / t[:, None]).to(module.weight.dtype)
        if getattr(module, "bias", None) is not None:
            module.bias.data = (module.bias.data.float() / t).to(module.bias.dtype)


def _kv_tie(config, K: int):
    """For o_proj: a function projecting a (heads * head_dim,) scale onto one value per KV head
    dim (the mean over the query heads that read that KV head), or None if shapes disagree."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    H = text.num_attention_heads
    KVH = getattr(text, "num_key_value_heads", None) or H
    D = getattr(text, "head_dim", None) or text.hidden_size // H
    if H * D != K or H % KVH:
        return None, None
    rep = H // KVH

    def tie(s):
        g = s.reshape(KVH, rep, D).mean(axis=1)  # (KVH, D)
        return np.repeat(g[:, None, :], rep, axis=1).reshape(K)

    def per_kv(s):
        return s.reshape(KVH, rep, D)[:, 0, :].reshape(KVH * D)

    return tie, per_kv


class AwqGroup(NamedTuple):
    """Linears that share an input, whose channel scaling is searched and folded together."""
    label: str
    linears: list
    names: list  # module names; names[0] keys the shared input's statistics
    producer: object  # the module whose output channels absorb 1 / s
    kv: tuple | None  # o_proj: (tie, per_kv) of _kv_tie
    producer_name: str | None  # the producer's name, if it is a linear (its gradient moves)
    quantize: object  # the weight round trip of the group's format


def _awq_groups(model, calib: Calibration, quantizer_for) -> list:
    """AwqGroup per linear group the scale search scores, in the model's order."""
    groups = []
    for i, attn, mlp, norm1, norm2 in _layer_modules(model):
        pre = f"model.layers.{i}"
        layer = [
            (f"{pre}.self_attn.q_proj|k_proj|v_proj", [attn.q_proj, attn.k_proj, attn.v_proj],
             [f"{pre}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], norm1, None, None),
            (f"{pre}.mlp.gate_proj|up_proj", [mlp.gate_proj, mlp.up_proj],
             [f"{pre}.mlp.{p}" for p in ("gate_proj", "up_proj")], norm2, None, None),
            (f"{pre}.mlp.down_proj", [mlp.down_proj], [f"{pre}.mlp.down_proj"], mlp.up_proj, None,
             f"{pre}.mlp.up_proj"),
        ]
        tie, per_kv = _kv_tie(model.config, attn.o_proj.in_features)
        if tie is not None:
            layer.append((f"{pre}.self_attn.o_proj", [attn.o_proj], [f"{pre}.self_attn.o_proj"],
                          attn.v_proj, (tie, per_kv), f"{pre}.self_attn.v_proj"))
        for label, lins, names, producer, kv, producer_name in layer:
            if names[0] not in calib.stats:
                continue
            fq = quantizer_for([f"{n}.weight" for n in names])
            if fq is not None:  # None: stays float, nothing to gain
                groups.append(AwqGroup(label, lins, names, producer, kv, producer_name, fq))
    return groups


def apply_awq(model, calib: Calibration, quantizer_for, quantize_input=None,
              activations: str = "float", log=print) -> dict:
    """Search and fold the scales of every linear group into `model` (in place); update
    `calib`'s statistics to the scaled inputs. `quantizer_for(names) -> fn(w) -> w'` gives the
    weight round trip of the linear made of those checkpoint weight names (a merged linear
    uses one format). Returns {group label: {"scale": label, "error_ratio": err / err(s=1)}}.

    The groups are searched one per thread, all cores busy, while this thread folds the
    chosen scales in the groups' order. Each search reads only its own group's weights and
    statistics, and a fold writes its group's weights and its producer's rows (q|k|v's norm,
    gate|up's norm, down's up_proj, o's v_proj), which only earlier groups' searches read:
    a fold runs after every earlier group's result is in, so each search sees what it saw
    when the groups ran one after another, and chooses the same scale. (Searching one group
    at a time, its candidates in threads, left the cores idle while a fold ran: llama-1b
    ~5 s of its ~15 s.)"""
    groups = _awq_groups(model, calib, quantizer_for)

    def search(g: AwqGroup):
        weights = [lin.weight.detach().float().numpy() for lin in g.linears]
        return search_scale(calib.stats[g.names[0]], weights, g.quantize, quantize_input,
                            activations, tie=g.kv[0] if g.kv else None)

    report = {}
    with one_torch_thread(), ThreadPoolExecutor(min(len(groups), host_threads()) or 1) as pool:
        searches = [pool.submit(search, g) for g in groups]
        try:
            for g, fut in zip(groups, searches):
                chosen, s, err, base = fut.result()
                report[g.label] = {"scale": chosen, "error_ratio": err / base if base else 1.0}
                if chosen == "awq 0.0":
                    continue
                _scale_inputs(g.linears, s)
                rows = g.kv[1](s) if g.kv else s
                _scale_outputs(g.producer, rows)
                if g.producer_name in calib.out_grad_sq:  # y / s has gradient s * dL/dy
                    calib.out_grad_sq[g.producer_name] = calib.out_grad_sq[g.producer_name] * rows ** 2
                for n in g.names:
                    calib.stats[n] = calib.stats[n].scaled(s)
        finally:
            for fut in searches:  # an error or Ctrl-C: start no further search
                fut.cancel()
    calib.scales = report
    return report


def summarize(report: dict) -> str:
    """One line: how many groups were scaled and the mean output-error ratio."""
    if not report:
        return "no linear group scaled"
    ratios = [r["error_ratio"] for r in report.values()]
    scaled = sum(r["scale"] != "awq 0.0" for r in report.values())
    smooth = sum(r["scale"].startswith("smooth") for r in report.values())
    return (f"{scaled}/{len(report)} linear groups scaled ({smooth} SmoothQuant-style), output "
            f"error on the calibration sample x{np.mean(ratios):.3f} of unscaled (mean)")


# ------------------------------------------------------------------------------ the build hook

METHODS = ("awq", "importance")
# measured on SmolLM2-135M (README): awq took W8A8 from +0.76% to +0.23% and, for q4_k, chose
# no scaling by itself; importance made q4_k worse (+0.63% vs +0.42%): off unless asked
DEFAULT_METHODS = ("awq",)
# what the CLI's "our best" names calibrate by default (exact format names and the Python API
# calibrate only when asked): q4 = the calibrated mix at <= 4.6 bits per weight of the layers;
# q8 = channel scaling (with int8 activations it took W8A8 from +0.76% to +0.23%, README)
CLI_DEFAULTS = {"q4": {"bits_per_weight": 4.6}, "q8": {"calibrate": "awq"}}


def layout_budget(bits_per_weight: float, default_format: str, activations: str) -> float:
    """CLI_DEFAULTS' budget is in stored bits of the int8-activation ("vnni") layout, where q4_k
    takes 4.5 bits. A build whose layout stores the default format at more bits (weight-only
    "rows": float32 group scale and offset, q4_k 6.0 bits) gets the same allowance above an
    all-default build: the budget plus the difference (else the default could not fit at all)."""
    from .scheme import layout_for, stored_bits

    extra = stored_bits(default_format, 16, 256, layout_for(activations, 16, 256)) \
        - stored_bits(default_format, 16, 256, "vnni")
    return round(bits_per_weight + max(extra, 0.0), 4)
# 256-token windows of the calibration text (512 tokens): 2 windows and 4 chose the same AWQ
# scales on SmolLM2-135M at half the forward + backward, the build's largest calibration step
DEFAULT_WINDOWS = 2
# windows whose backward gives the mix's loss gradients (the others run forward only, for the
# statistics): 1 of 2 chose the same mix as 2 of 2 on SmolLM2-135M (byte-identical q4 weights)
# and on llama-1b, at 3/4 of the forward + backward (README "Build time", stop 21)
GRADIENT_WINDOWS = 1
# formats a unit may be raised to from the plan's default, by what the budget counts (mix.COUNTS).
# With the LM head counted ("all") the 5 and 6-bit k-quants are the steps a large head can
# afford where q8_0 never fits: on SmolLM2-135M (W4A8, runtime, 8 windows) the head rose from
# q4_k to q5_k / q6_k at the same stored bits, 4.8 bits +8.25% -> +1.98% perplexity, 5.2 bits
# +8.31% -> +1.31%. With the head outside the budget ("body", the default; the head takes
# q8_0) the steps only spread the layers' ~0.1 bit of headroom differently, and there they
# measured worse: q4 -0.03% with q8_0 alone against +0.65% with the steps (simulated +0.54%
# against +0.82%): the Fisher estimate does not rank such small upgrades reliably
MIX_CANDIDATES = {"body": ("q8_0",), "all": ("q5_k", "q6_k", "q8_0")}


def parse_methods(methods) -> tuple:
    if methods is None:
        return DEFAULT_METHODS
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = tuple(m for m in methods if m != "none")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise UserError(f"unknown --calibrate method {bad[0]!r}: choose from {', '.join(METHODS)} "
                        "or none")
    return methods


def _scheme_quantizers(scheme):
    """(quantizer_for, quantize_input) for a QuantScheme build (one format everywhere)."""
    from .scheme import fake_quantize_np

    def quantizer_for(names):
        if scheme.keeps_float(names):
            return None
        return lambda w: fake_quantize_np(w, scheme) if scheme.applies_to(w.shape[1], w.shape[0]) else w

    def per_token(x):
        s = np.abs(x).max(axis=-1, keepdims=True) / 127.0
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.clip(np.round(x / np.where(s > 0, s, 1)), -127, 127), 0)
        return (q * s).astype(np.float32)

    return quantizer_for, (per_token if scheme.activations == "int8" else None)


def fast_activation_round_trip(x: np.ndarray) -> np.ndarray:
    """formats.fake_quantize_activation (the int8 kernels' per-32-block round trip) in torch,
    on the caller's torch threads, for the scale search that runs it once per candidate: the
    same IEEE float32 operations (block max |x|, 127 / max, product, round half to even, clip,
    times max / 127), so the same values, at ~1/3 of numpy's time (block reductions)."""
    import torch

    from .formats import ACTIVATION_BLOCK

    N, K = x.shape
    b = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).view(N, K // ACTIVATION_BLOCK,
                                                                          ACTIVATION_BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    pos = amax > 0
    inv = torch.where(pos, 127 / torch.where(pos, amax, 1), 0)
    q = torch.clamp(torch.round(b * inv), -127, 127)
    return (q * (amax / 127)).view(N, K).numpy()


def _plan_quantizers(plan):
    """(quantizer_for, quantize_input) for the scale search: the round-to-nearest stand-in of
    each linear's format (fast_round_trip) and the int8 activation round trip."""
    from .formats import FORMATS
    from .plan import FLOAT

    def quantizer_for(names):
        fmt = plan.format_for(names)
        if fmt == FLOAT:
            return None
        return lambda w: fast_round_trip(w, fmt) if FORMATS[fmt].applies_to(*w.shape) else w

    return quantizer_for, (fast_activation_round_trip if plan.activations == "int8" else None)


def calibrate_for_build(model, model_dir: str, quant, text_path: str | None = None, methods=None,
                        bits_per_weight: float | None = None, count: str = "body",
                        windows: int = DEFAULT_WINDOWS, log=print):
    """Calibrate the float transformers `model` in place before export and return
    (quantization, report): AWQ-style scales folded into the weights ("awq"), importance for
    the rounding ("importance") and, with `bits_per_weight`, the automatic mix. `quant` is the
    build's QuantPlan (or a legacy QuantScheme: then only "awq" applies, nothing else changes)."""
    import time

    from dataclasses import replace

    from .scheme import QuantScheme

    if isinstance(quant, QuantScheme) and getattr(quant, "plan", None) is not None:
        # a scheme that carries its QuantPlan: calibrate the plan, keep the rest
        plan, report = calibrate_for_build(model, model_dir, quant.plan, text_path, methods,
                                           bits_per_weight, count, windows, log)
        return replace(quant, plan=plan), report
    methods = parse_methods(methods)
    legacy = isinstance(quant, QuantScheme)
    if bits_per_weight is not None:  # checked before the (slow) calibration pass
        from .scheme import layout_for, stored_bits

        layout = layout_for(quant.activations, 16, 256)
        lowest = quant.bits + 0.5 if legacy else stored_bits(quant.default_format, 16, 256, layout)
        if not bits_per_weight >= lowest - 1e-9:
            raise UserError(f"--bits-per-weight {bits_per_weight:g} is below the cheapest mix "
                            f"({lowest:g} stored bits per weight with every weight in the default "
                            f"format, {layout!r} layout); raise it")
    if not methods and bits_per_weight is None:
        return quant, None
    t0 = time.perf_counter()
    wins = token_windows(model_dir, read_calibration(text_path), 256, windows)
    need_grads = bits_per_weight is not None and not legacy
    log(f"[tvm-llm] calibrating on {sum(len(w) - 1 for w in wins)} tokens of "
        f"{text_path or 'the bundled calibration text'} ({', '.join(methods) or 'mix only'})")
    calib = collect(model, wins, gradients=need_grads, gradient_windows=GRADIENT_WINDOWS)
    stages = {"forward + backward" if need_grads else "forward": round(time.perf_counter() - t0, 1)}
    report = {"text": os.path.abspath(text_path or DEFAULT_CALIBRATION), "tokens": calib.tokens,
              "methods": list(methods), "stage_seconds": stages}
    quantizer_for, quantize_input = _scheme_quantizers(quant) if legacy else _plan_quantizers(quant)
    activations = quant.activations
    if "awq" in methods:
        t1 = time.perf_counter()
        scales = apply_awq(model, calib, quantizer_for, quantize_input, activations)
        stages["awq scale search"] = round(time.perf_counter() - t1, 1)
        report["awq"] = summarize(scales)
        log(f"[tvm-llm] activation-aware scaling: {report['awq']}")
    if legacy:  # one format everywhere: no importance, no mix
        if bits_per_weight is not None:
            log("[tvm-llm] the automatic mix needs per-weight formats (a QuantPlan); not applied")
        report["seconds"] = round(time.perf_counter() - t0, 1)
        return quant, report
    from . import mix

    importance = {}
    if "importance" in methods:
        importance = calib.importance()
        _alias_head(model, importance)
    formats = dict(quant.formats)
    if bits_per_weight is not None:
        candidates = [quant.default_format] + [f for f in MIX_CANDIDATES.get(count, ())
                                               if f != quant.default_format]
        t1 = time.perf_counter()
        units = fisher_units(model, calib, candidates, importance or None)
        stages["mix (Fisher estimate)"] = round(time.perf_counter() - t1, 1)
        choice = mix.choose(units, candidates, bits_per_weight, count, quant.activations)
        formats.update(mix.to_formats(units, choice))
        _alias_head(model, formats)
        report["mix"] = mix.format_mix(units, choice, quant.default_format, quant.activations)
        report["bits_per_weight"] = {c: round(mix.average_bits(units, choice, c, quant.activations), 4)
                                     for c in mix.COUNTS}
        report["budget"] = {"bits_per_weight": bits_per_weight, "count": count}
        log(f"[tvm-llm] {report['mix']}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    log("[tvm-llm] calibration stages (wall s): " + ", ".join(f"{k} {v}" for k, v in stages.items()))
    return replace(quant, formats=formats, importance=importance), report


def _alias_head(model, table: dict) -> None:
    """A tied LM head is the embedding table: give its entry under both names."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is emb.weight and "lm_head.weight" in table:
        emb_name = next(n for n, m in model.named_modules() if m is emb) + ".weight"
        table[emb_name] = table["lm_head.weight"]


def _fisher_rows(G: np.ndarray):
    """(rows, weights): FISHER_ROWS rows drawn with probability proportional to their squared
    gradient G, systematically (at evenly spaced quantiles of cumsum(G): deterministic; a
    heavy row can be drawn several times), and the weight of each drawn row such that
    sum_j weight_j e_j estimates sum_i G_i e_i for any per-row error e. Rows drawn evenly
    would miss the few heavy rows of an LM head (the vocabulary rows of the calibration
    text's tokens: the estimate came out at half of all rows' on the bundled model)."""
    cg = np.cumsum(G)
    picks = np.searchsorted(cg, (np.arange(FISHER_ROWS) + 0.5) / FISHER_ROWS * cg[-1], side="right")
    rows, counts = np.unique(np.minimum(picks, len(G) - 1), return_counts=True)
    return rows, counts * (cg[-1] / FISHER_ROWS)


def fisher_units(model, calib, candidates: list, importance: dict | None = None,
                 exact: bool = False) -> list:
    """mix.Unit per stored matrix (merged q|k|v and gate|up, o_proj, down_proj, the LM head)
    with its estimated loss increase in each candidate format: sum E[g_i^2] E[x_k^2] dW_ik^2
    from a calibration with gradients (calibration.collect(..., gradients=True)). The LM head
    must be untied first if the build quantizes a copy of a tied embedding (untie_head).
    `exact`: round with the formats' own quantizers (importance-weighted); default: their
    round-to-nearest stand-in (calibration.fast_round_trip), ~50x cheaper on a whole model."""
    from .formats import FORMATS, fake_quantize
    from .mix import Unit
    from .simulation import merged_names, plan_linears

    linears = plan_linears(model)
    module_of = {id(m): n for n, m in model.named_modules()}
    jobs, seen = [], set()
    for name in linears:
        if name in seen:
            continue
        names = [n for n in merged_names(name) if n in linears]
        seen.update(names)
        mods = [linears[n] for n in names]
        stat_names = [module_of[id(m)] for m in mods]
        if any(s not in calib.out_grad_sq for s in stat_names) or stat_names[0] not in calib.stats:
            continue
        jobs.append((names, mods, stat_names))

    def unit(job):
        names, mods, stat_names = job
        W = np.concatenate([m.weight.detach().float().numpy() for m in mods])
        G = np.concatenate([calib.out_grad_sq[s] for s in stat_names]).astype(np.float64)
        shape = W.shape
        if FISHER_ROWS and len(W) > FISHER_ROWS and not exact and G.sum() > 0:
            rows, G = _fisher_rows(G)  # G: each drawn row's weight in the estimate
            W = W[rows]
        X = calib.stats[stat_names[0]].mean_sq.astype(np.float64)
        imp = None if importance is None else importance.get(names[0])
        errors = {}
        for fmt in candidates:
            if not FORMATS[fmt].applies_to(*W.shape):
                errors[fmt] = 0.0
                continue
            wq = fake_quantize(W, fmt, imp) if exact else fast_round_trip(W, fmt)
            d = (W - wq).astype(np.float64)
            errors[fmt] = float(G @ (d * d) @ X)
        return Unit(tuple(names), shape, errors)

    # one unit per thread at a time, one torch thread each (numpy and torch release the GIL);
    # the units keep their order, each computed as it would be alone
    with one_torch_thread(), ThreadPoolExecutor(min(len(jobs), host_threads()) or 1) as pool:
        return list(pool.map(unit, jobs))
