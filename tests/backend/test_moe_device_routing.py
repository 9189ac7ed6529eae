"""Device-resident MoE routing (hpcinfer/backend/cupy_moe.py) without a GPU.

1. cupy_moe.route_arrays (the plain-array route, the fallback of the moe_route kernel) on NumPy equals moe_ops.route.
2. The dispatcher's host-side send counts equal the bincount of its destinations (the formulation they replace),
   for every ep / expert_tp / pcc shape.
3. On tests/helpers/emu_cupy/ (a fake cupy whose kernels run on the CPU emulator): CupyOps.route / permute / unpermute,
   with the kernels and with plain CuPy, equal NumpyOps (capacity on and off, tied logits, experts nobody picks,
   everything dropped); the tables stay on the device and only the [E] counts are copied to the host; the fused
   moe_gate_dispatch equals gating + route + permute; a tiny DS-MoE model's MoE layer gives NumpyOps's output with
   exactly one host <-> device copy, and the whole model NumpyOps's logits.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from hpcinfer.backend import cupy_moe, moe_ops
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate
from hpcinfer.parallel.moe_dispatch import Dispatcher

F32 = np.float32
NUMPY = NumpyOps()
needs_emulator = pytest.mark.skipif(emulate.unavailable() is not None,
                                    reason=f"kernel emulator unavailable: {emulate.unavailable()}")

# (tokens, experts, k, capacity): no limit, a limit that drops, capacity 0 (everything dropped), top-1 with more
# experts than tokens (experts nobody picks), a single token
SHAPES = [(20, 6, 2, None), (20, 6, 2, 3), (9, 4, 2, 0), (5, 16, 1, 1), (1, 3, 3, None)]


def gating(rng, tokens, experts, k):
    """logits [T, E] with a row of ties (the lower expert wins) and their top-k (experts, weights)."""
    logits = (rng.standard_normal((tokens, experts)) * 2).astype(F32)
    logits[tokens // 2] = 0.25
    return logits, *moe_ops.top_k_gating(logits, k, "topk")


ROUTING_FIELDS = [f.name for f in dataclasses.fields(moe_ops.Routing)]       # the spec's tables, not a subclass's


# ---- 1. the plain-array route on NumPy -------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,experts,k,capacity", SHAPES + [(0, 4, 2, None)])
def test_route_arrays_on_numpy_equals_the_spec(tokens, experts, k, capacity):
    _, chosen, weights = gating(np.random.default_rng(tokens * 7 + k), max(tokens, 1), experts, k)
    chosen, weights = chosen[:tokens], weights[:tokens]
    want = moe_ops.route(chosen, weights, experts, capacity)
    got = cupy_moe.route_arrays(np, np.asarray, chosen, weights, experts, capacity)
    for name in ROUTING_FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert getattr(got, name).dtype == getattr(want, name).dtype, name


# ---- 2. the dispatcher's send counts ---------------------------------------------------------------------------
def _old_destinations(d: Dispatcher, expert_of_row):
    """The NumPy formulation the dispatcher had: every copy's destination, then a stable sort and a bincount."""
    R, etp = len(expert_of_row), d.expert_tp
    copy_row = np.repeat(np.arange(R), etp)
    dest = (expert_of_row[copy_row] // d.local_experts) * etp + np.tile(np.arange(etp), R)
    if d.pcc:
        mine = dest % d.tp.size == d.tp.rank
        copy_row, dest = copy_row[mine], dest[mine] // d.tp.size
    order = np.argsort(dest, kind="stable")
    return copy_row[order], np.bincount(dest, minlength=d.group.size)


@pytest.mark.parametrize("ep,etp,tp", [(1, 2, 1), (2, 1, 1), (4, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 4), (1, 4, 2)])
def test_send_counts_from_the_expert_counts_equal_the_bincount_of_destinations(ep, etp, tp):
    experts, stage = 8, ep * etp
    rng = np.random.default_rng(ep * 100 + etp * 10 + tp)
    routing = moe_ops.route(rng.integers(0, experts, (30, 2)), rng.random((30, 2)).astype(F32), experts, 5)
    for tp_rank in range(tp):
        d = Dispatcher.__new__(Dispatcher)
        d.ops, d.local_experts, d.expert_tp = NUMPY, experts // ep, etp
        d.tp = SimpleNamespace(size=tp, rank=tp_rank)
        d.pcc = tp > 1
        d.group = SimpleNamespace(size=stage // tp if d.pcc else stage)
        want_rows, want_counts = _old_destinations(d, routing.expert_of_row)
        counts = d._send_counts(routing.expert_counts)
        np.testing.assert_array_equal(counts, want_counts)
        np.testing.assert_array_equal(d._destinations(routing.expert_of_row, int(counts.sum())), want_rows)


# ---- 3. CupyOps on the emulated cupy ---------------------------------------------------------------------------
@pytest.fixture(params=["kernels", "plain-cupy"])
def emu(request, monkeypatch):
    """(fake cupy module, CupyOps on it, a list of the host <-> device copies it makes), per kernel setting."""
    import emu_cupy

    cp = emu_cupy.install(monkeypatch)
    from hpcinfer.backend.cupy_ops import CupyOps

    copies: list = []
    state = emu_cupy._state
    real = state.host_sync
    monkeypatch.setattr(state, "host_sync", lambda what: (copies.append(what), real(what))[1])
    return cp, CupyOps(device=0, kernels=request.param == "kernels"), copies


@needs_emulator
@pytest.mark.parametrize("tokens,experts,k,capacity", SHAPES)
def test_route_permute_unpermute_on_the_device_equal_numpy(emu, tokens, experts, k, capacity):
    cp, gpu, copies = emu
    rng = np.random.default_rng(tokens + experts)
    _, chosen, weights = gating(rng, tokens, experts, k)
    x = rng.standard_normal((tokens, 24)).astype(F32)
    want = NUMPY.route(chosen, weights, experts, capacity)
    d_chosen, d_weights, d_x = gpu.asarray(chosen), gpu.asarray(weights), gpu.asarray(x)

    copies.clear()
    got = gpu.route(d_chosen, d_weights, experts, capacity)
    assert len(copies) == 1 and "device -> host" in copies[0], copies           # the [E] counts, nothing else
    assert isinstance(got.expert_counts, np.ndarray)
    assert (got.num_rows_d is not None) == gpu.kernels                          # moe_route ran
    for name in ROUTING_FIELDS:
        value = getattr(got, name)
        assert name == "expert_counts" or isinstance(value, cp.ndarray), f"{name} left the device"
        np.testing.assert_array_equal(gpu.to_host(value), getattr(want, name), err_msg=name)
        assert gpu.to_host(value).dtype == getattr(want, name).dtype, name

    copies.clear()
    rows = gpu.permute(d_x, got)
    np.testing.assert_array_equal(gpu.to_host(rows), NUMPY.permute(x, want))
    expert_out = rng.standard_normal((want.num_rows, 24)).astype(F32)
    d_expert_out = gpu.asarray(expert_out)
    copies.clear()
    out = gpu.unpermute(d_expert_out, got, tokens)
    assert copies == []
    np.testing.assert_allclose(gpu.to_host(out), NUMPY.unpermute(expert_out, want, tokens), rtol=1e-6, atol=1e-6)


@needs_emulator
@pytest.mark.parametrize("tokens,experts,k,capacity", SHAPES[:4])
def test_the_fused_gate_dispatch_equals_gating_route_permute(emu, tokens, experts, k, capacity):
    cp, gpu, copies = emu
    rng = np.random.default_rng(3 * tokens + k)
    logits, chosen, weights = gating(rng, tokens, experts, k)
    x = rng.standard_normal((tokens, 19)).astype(F32)
    fused = cupy_moe.gate_dispatch(gpu, gpu.asarray(logits), gpu.asarray(x), k, "topk", experts, capacity)
    if not gpu.kernels:
        assert fused is None                            # no kernel: the caller runs the three steps
        return
    got_experts, got_weights, routing, rows = fused
    want = moe_ops.route(chosen, weights, experts, capacity)
    np.testing.assert_array_equal(gpu.to_host(got_experts), chosen)
    np.testing.assert_allclose(gpu.to_host(got_weights), weights, rtol=1e-6)
    for name in ROUTING_FIELDS:
        got = gpu.to_host(getattr(routing, name))
        if name == "weight_of_row":
            np.testing.assert_allclose(got, want.weight_of_row, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(gpu.to_host(rows), moe_ops.permute(x, want))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A DS-MoE GPT (tests/helpers/moe_models.py) with top-2 routing and a capacity that drops tokens."""
    from moe_models import moe_arch, write_checkpoint

    path = tmp_path_factory.mktemp("device-routing") / "top2.h5"
    write_checkpoint(path, moe_arch(top_k=2, capacity_factor=1.0))
    return str(path)


@needs_emulator
def test_a_moe_layer_on_the_device_equals_numpy_with_one_copy(emu, tiny_moe):
    from hpcinfer.api import load_model, prompt_logits
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.moe import MoE
    from hpcinfer.model.transformer import Decoder
    from hpcinfer.checkpoint.format import open_checkpoint

    cp, gpu, copies = emu
    cpu_model = load_model(tiny_moe)
    with open_checkpoint(tiny_moe) as ckpt:
        gpu_model = Decoder(gpu, Groups(), ckpt.arch).load(ckpt)
    layer = next(i for i, b in enumerate(cpu_model.blocks) if isinstance(b.mlp, MoE))
    x = np.random.default_rng(1).standard_normal((23, cpu_model.arch.hidden_size)).astype(F32)
    want = cpu_model.blocks[layer].mlp(x)
    d_x = gpu.asarray(x)
    copies.clear()
    got = gpu_model.blocks[layer].mlp(d_x)                  # gating, route, permute, experts, unpermute
    assert len(copies) == 1 and "device -> host" in copies[0], copies
    np.testing.assert_allclose(gpu.to_host(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 11]
    want, got = prompt_logits(cpu_model, prompts), prompt_logits(gpu_model, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_emulator
@pytest.mark.parametrize("tokens", [5, cupy_moe.FUSED_MAX_TOKENS + 1])
def test_the_moe_layer_runs_the_fused_kernel_for_decode_sized_steps(emu, tiny_moe, monkeypatch, tokens):
    """MoE.__call__ goes through Ops.gate_dispatch: one moe_gate_dispatch launch (gating + tables + row scatter)
    up to FUSED_MAX_TOKENS tokens with the kernels, the three separate ops above it (and without kernels); the
    layer's output equals NumPy's either way."""
    from hpcinfer.api import load_model
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.moe import MoE
    from hpcinfer.model.transformer import Decoder

    _, gpu, _ = emu
    fused = []
    real = cupy_moe.gate_dispatch
    monkeypatch.setattr(cupy_moe, "gate_dispatch", lambda *a: fused.append(real(*a)) or fused[-1])
    cpu_model = load_model(tiny_moe)
    with open_checkpoint(tiny_moe) as ckpt:
        gpu_model = Decoder(gpu, Groups(), ckpt.arch).load(ckpt)
    layer = next(i for i, b in enumerate(cpu_model.blocks) if isinstance(b.mlp, MoE))
    x = np.random.default_rng(2).standard_normal((tokens, cpu_model.arch.hidden_size)).astype(F32)
    want = cpu_model.blocks[layer].mlp(x)
    got = gpu.to_host(gpu_model.blocks[layer].mlp(gpu.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ran_fused = [f is not None for f in fused]
    assert ran_fused == ([gpu.kernels] if tokens <= cupy_moe.FUSED_MAX_TOKENS else [])
