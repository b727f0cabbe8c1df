"""The whole pipeline on an imported Llama: what the graph looks like after each phase."""
import numpy as np
import pytest
import tvm
from tvm import relax

from relax_util import op_names
from tvm_llm.passes.pipeline import kernels_per_call, phase_passes, run_pipeline

LAYERS = 2


@pytest.fixture(scope="module")
def llama_phases(checkpoint, tmp_path_factory):
    """The imported tiny Llama run through the pipeline, with the IR kept after each phase."""
    import tvm_llm  # noqa: F401
    from tvm_llm.frontend import import_model, load_model, read_config
    from tvm_llm.targets import get_target

    spec = get_target("llvm")
    ck = checkpoint("llama")
    model = load_model(ck, read_config(ck), "float32")
    imported = import_model(model, dtype="float32", context_window=256, max_batch_size=4,
                            prefill_chunk_size=64, target=spec)
    snapshots = {}
    mod = imported.mod
    with spec.tvm_target():
        for name, passes in phase_passes(spec):
            if name in ("lowering", "scheduling", "finalize"):
                break
            mod = tvm.transform.Sequential(passes)(mod)
            snapshots[name] = mod
    final, transforms, report = run_pipeline(imported.mod, spec)
    return snapshots, final, transforms, report


def _bare_linear_chains(func) -> int:
    """reshape -> matmul -> reshape chains (the importer's flattened linears)."""
    bindings = {}
    for block in func.body.blocks:
        for b in block.bindings:
            bindings[b.var] = b.value
    count = 0
    for value in bindings.values():
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.reshape":
            inner = bindings.get(value.args[0], value.args[0])
            if isinstance(inner, relax.Call) and getattr(inner.op, "name", "") == "relax.matmul":
                lhs = bindings.get(inner.args[0], inner.args[0])
                if isinstance(lhs, relax.Call) and getattr(lhs.op, "name", "") == "relax.reshape":
                    count += 1
    return count


def test_no_bare_reshape_matmul_reshape_chains(llama_phases):
    """A float32 model is imported without torch's decompositions (relax_import.to_relax), so
    its linears arrive 3-D; after fusion none is a flattened reshape -> matmul -> reshape
    (UnflattenLinear's own tests cover the decomposed imports of half-precision models)."""
    snapshots, *_ = llama_phases
    for phase in ("import_cleanup", "fusion"):
        assert _bare_linear_chains(snapshots[phase]["decode"]) == 0, phase


def test_rms_norm_is_one_op_and_linears_are_merged(llama_phases):
    snapshots, *_ = llama_phases
    ops = op_names(snapshots["fusion"]["decode"])
    assert ops.count("relax.nn.rms_norm") == 2 * LAYERS + 1
    assert "relax.rsqrt" not in ops
    # after merging q|k|v and gate|up: qkv, o, gate_up, down per layer, plus lm_head
    # (FuseTransposeMatmul has turned each matmul(x, permute_dims(W)) into an NT matmul kernel)
    matmuls = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir" \
                and "matmul" in e.args[0].name_hint:
            matmuls.append(e)

    relax.analysis.post_order_visit(snapshots["fusion"]["decode"], visit)
    assert len(matmuls) == 4 * LAYERS + 1


def _weight_only_bindings(func) -> list:
    """Bindings whose value depends on weights and constants alone (work a call would redo)."""
    n_in = int(func.attrs["num_input"])
    weight_only = set(func.params[n_in:])
    found = []
    for block in func.body.blocks:
        for b in block.bindings:
            free = relax.analysis.free_vars(b.value)
            if all(v in weight_only for v in free) and isinstance(b.value, relax.Call):
                found.append(b.var.name)
                weight_only.add(b.var)
            elif free and all(v in weight_only for v in free):
                weight_only.add(b.var)  # aliases of weights
    return found


def test_runtime_performs_no_weight_transform(llama_phases):
    snapshots, final, transforms, _ = llama_phases
    assert transforms  # the merged weights are computed at build time ...
    assert _weight_only_bindings(snapshots["fusion"]["decode"])  # (they were per-call work)
    folded = snapshots["folding"]
    for name in ("prefill", "decode"):  # ... and nothing weight-only is left in the hot functions
        assert _weight_only_bindings(folded[name]) == []


def test_report_counts_kernels(llama_phases):
    _, final, _, report = llama_phases
    total = report[-1]
    assert total["phase"] == "total"
    assert total["decode_kernels"] == kernels_per_call(final, "decode")
    # per layer: norm, qkv, rope, attention, o+residual, norm, gate_up, silu*up, down+residual;
    # once: id cast, embedding, rope tables (3), final norm, lm_head
    assert total["decode_kernels"] <= 9 * LAYERS + 7


def test_phase_ablation_keeps_numerics(checkpoint, built, tmp_path):
    """Switching optional phases off changes speed, never results (one build with both
    off: each build costs ~15 s of the suite's time budget)."""
    import tvm_llm
    from tvm_llm import Engine

    prompt = [5, 17, 33, 200, 7, 9]
    ref = Engine(built("llama"))
    sid = ref.cache.add()
    expected = ref.prefill_positions([sid], [6], np.array([prompt]), np.arange(6)[None], np.arange(6))
    for off in (("fusion", "folding"),):
        out = str(tmp_path / f"off_{off[0]}")
        tvm_llm.build(checkpoint("llama"), out, max_batch_size=4, prefill_chunk_size=64,
                      disabled_phases=off, log=lambda *a: None)
        eng = Engine(out)
        s = eng.cache.add()
        got = eng.prefill_positions([s], [6], np.array([prompt]), np.arange(6)[None], np.arange(6))
        np.testing.assert_allclose(got, expected, atol=1e-4)
