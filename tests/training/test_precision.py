"""``compute_dtype`` (pepo.training.precision): what ``auto`` chooses, and that the rollouts and
the trainer's forward both run their body under bf16 autocast with the output head in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from pepo.training import precision
from pepo.training.engines import build_engine
from pepo.training.generation import Rollouts, pad_prompts
from pepo.training.precision import (
    autocast,
    cpu_attention_in_fp32,
    resolve_compute_dtype,
    units_in_cpuinfo,
)
from pepo.training.step import policy_logprobs

CPU = torch.device("cpu")


def test_bf16_units_read_from_cpuinfo():
    """A Sapphire Rapids Xeon names both units, a Zen 4 EPYC one, an AVX-512 CPU without bf16
    none (catches ``avx512f`` or ``amx_tile`` taken for bf16 matmuls), an Arm CPU ``bf16`` on
    its Features line."""
    xeon = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile avx512_bf16 amx_int8\n"
    epyc = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    old = "flags\t\t: fpu avx2 avx512f avx512_vnni amx_tile\n"
    arm = "Features\t: fp asimd bf16 i8mm\n"
    assert units_in_cpuinfo(xeon) == ("amx_bf16", "avx512_bf16")
    assert units_in_cpuinfo(epyc) == ("avx512_bf16",)
    assert units_in_cpuinfo(old) == ()
    assert units_in_cpuinfo(arm) == ("bf16",)
    assert units_in_cpuinfo("model name\t: bf16 avx512_bf16\n") == ()  # flags lines only


@pytest.mark.parametrize("units, want", [(("avx512_bf16",), torch.bfloat16), ((), None)])
def test_auto_is_bf16_only_on_a_cpu_with_bf16_units(monkeypatch, units, want):
    """``auto``: bf16 with the units, no autocast without (catches auto always bf16, which is
    emulated and slow there) and never on a GPU (the GPU configs train bf16 parameters);
    ``fp32`` and ``bf16`` force either; anything else is an error naming it."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: units)
    assert resolve_compute_dtype("auto", CPU) is want
    assert resolve_compute_dtype("auto", torch.device("cuda")) is None
    assert resolve_compute_dtype("bf16", CPU) is torch.bfloat16
    assert resolve_compute_dtype("fp32", CPU) is None
    with pytest.raises(ValueError, match="got 'fp16'"):
        resolve_compute_dtype("fp16", CPU)
    line = precision.describe("auto", want, CPU)
    assert line.startswith("matmuls in bf16") == bool(units)
    assert ("avx512_bf16" in line) == bool(units)


def test_cpu_warnings_say_what_a_precision_setting_costs(monkeypatch):
    """Forced bf16 products on a CPU without bf16 units (emulated: several times slower, and
    the log said only "compute_dtype=bf16") and bf16 parameters on a CPU (the schema says bf16
    is for GPUs) are each one warning; auto's choices and GPUs get none. Catches either
    warning missing or given where it is wrong."""
    bf16 = torch.bfloat16
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ())
    (slow,) = precision.cpu_warnings(bf16, "fp32", CPU)
    assert "without bf16 matrix units" in slow and "slower than fp32" in slow
    assert precision.cpu_warnings(None, "fp32", CPU) == []
    assert precision.cpu_warnings(bf16, "bf16", torch.device("cuda")) == []
    (weights,) = precision.cpu_warnings(None, "bf16", CPU)
    assert weights.startswith("dtype=bf16 on a CPU")
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("amx_bf16",))
    assert precision.cpu_warnings(bf16, "fp32", CPU) == []


@pytest.fixture(scope="module")
def model():
    from pepo.training.models import tiny_qwen3

    torch.manual_seed(0)
    return tiny_qwen3(embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_dim=64, head_dim=16).eval()


def _record_dtypes(model):
    """Records the output dtypes of the first layer's MLP down-projection and of the output
    head (a tied head is no module: it is swapped for a recording one); returns the record and
    an undo function."""
    from torchtune.modules import TiedLinear

    seen = {"body": set(), "head": set()}
    hook = model.layers[0].mlp.w2.register_forward_hook(lambda m, i, o: seen["body"].add(o.dtype))
    tied = model.output

    class Recording(TiedLinear):
        def __init__(self) -> None:
            self.__dict__.update(tied.__dict__)

        def __call__(self, x):
            out = super().__call__(x)
            seen["head"].add(out.dtype)
            return out

    model.output = Recording()

    def undo() -> None:
        hook.remove()
        model.output = tied

    return seen, undo


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_engine_and_trainer_forward_run_at_the_compute_dtype(model, dtype):
    """The in-process engine built with ``compute_dtype`` decodes under autocast (the body's
    products in bf16) and so does the trainer's forward under :func:`autocast`; the output head
    stays fp32 in both (catches an engine that ignores ``compute_dtype``, rollouts at another
    precision than training, and bf16 logits, whose rounding the log-probs would carry).
    Sampled log-probs then match the trainer's to the bf16 body's error, and exactly (1e-5)
    without autocast."""
    from torchtune.modules import TiedLinear

    seen, undo = _record_dtypes(model)
    try:
        engine = build_engine("inprocess", model, compute_dtype=dtype)
        prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
        ro = engine.generate(prompts, max_new_tokens=6, pad_id=0, stop_tokens=[1],
                             temperature=1.0, seeds=torch.arange(3))
        assert seen["body"] == {dtype or torch.float32} and seen["head"] == {torch.float32}
        seen["body"].clear(), seen["head"].clear()
        recording = model.output
        for from_hidden in (True, False):
            # from_hidden takes a TiedLinear itself, not the recording subclass: a call of it
            # would be recorded by TiedLinear's own call, wrapped here
            model.output = TiedLinear(model.tok_embeddings) if from_hidden else recording
            call = TiedLinear.__call__
            TiedLinear.__call__ = lambda self, x: seen["head"].add("called") or call(self, x)
            try:
                with torch.no_grad(), autocast(CPU, dtype):
                    lp, _ = policy_logprobs(model, ro, torch.arange(3), chunk_size=4,
                                            temperature=1.0, from_hidden=from_hidden)
            finally:
                TiedLinear.__call__ = call
                model.output = recording
            if not from_hidden:
                seen["head"].discard("called")  # the recording head calls TiedLinear's
            assert seen["body"] == {dtype or torch.float32}
            assert seen["head"] == ({torch.float32} if not from_hidden else set())
            gap = float((lp - ro.logprobs).abs()[ro.mask].max())
            assert gap < (5e-2 if dtype else 1e-5), gap
    finally:
        undo()


def test_reference_decoder_under_autocast(model):
    """The reference decoder (what a model the fast decoder cannot plan uses) under bf16
    autocast: its KV caches take the bf16 keys and values autocast's products make (an fp32
    cache raised "Index put requires the source and destination dtypes match") and its head
    makes fp32 logits, as the fast decoder's and the trainer's. Catches either left as it was
    (a crash; bf16 logits, whose rounding the sampled log-probs carry)."""
    from pepo.training.generation import generate

    seen, undo = _record_dtypes(model)
    try:
        with torch.no_grad(), autocast(CPU, torch.bfloat16):
            ro = generate(model, [[3, 4, 5, 6], [7, 8], [9, 10, 11]], max_new_tokens=6,
                          pad_id=0, stop_tokens=[1], temperature=1.0, seeds=torch.arange(3),
                          decoder="reference")
        assert seen["body"] == {torch.bfloat16} and seen["head"] == {torch.float32}
        assert "unembed" not in vars(model)  # the fp32 head is the decoder's only while it runs
        fast = build_engine("inprocess", model, compute_dtype=torch.bfloat16).generate(
            [[3, 4, 5, 6], [7, 8], [9, 10, 11]], max_new_tokens=6, pad_id=0, stop_tokens=[1],
            temperature=1.0, seeds=torch.arange(3))
    finally:
        undo()
    assert torch.equal(ro.tokens, fast.tokens) and torch.equal(ro.mask, fast.mask)
    torch.testing.assert_close(ro.logprobs[ro.mask], fast.logprobs[fast.mask], rtol=0,
                               atol=1e-4)


def test_trainer_head_is_fp32_under_autocast(model):
    """From the hidden states, under bf16 autocast, the log-probs are those of fp32 logits of
    the bf16 body's final states (a reference that applies the head by hand in fp32), not of
    bf16 logits (catches the chunked head left to autocast)."""
    ptok, pmask = pad_prompts([[3, 4, 5, 6], [7, 8]], pad_id=0)
    tokens = torch.tensor([[9, 10, 11], [12, 13, 0]])
    ro = Rollouts(ptok, pmask, tokens, tokens != 0, torch.tensor([True, True]))
    states = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: states.update(h=o))
    try:
        with torch.no_grad(), autocast(CPU, torch.bfloat16):
            lp, _ = policy_logprobs(model, ro, torch.arange(2), chunk_size=4, temperature=1.0,
                                    from_hidden=True)
    finally:
        hook.remove()
    logits = states["h"].double() @ model.output.tied_module.weight.double().t()  # [2, S, V]
    ref = torch.log_softmax(logits[:, 3:-1], -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(lp[ro.mask].double(), ref[ro.mask], rtol=1e-5, atol=1e-5)


def _attention_ref(q, k, v):
    """Causal softmax attention in float64 from the formula."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v


def test_cpu_attention_in_fp32(monkeypatch):
    """After :func:`cpu_attention_in_fp32`, a model's torchtune attention given bf16 inputs on a
    CPU inside bf16 autocast runs ``scaled_dot_product_attention`` on fp32 inputs and returns
    bf16 (catches the casts left out, or the output left fp32), with output and gradients
    within bf16's rounding of float64 attention of the same inputs; fp32 inputs reach the
    original call as they are; every attention module is changed once (a second call changes
    none: catches a wrapper wrapped again)."""
    from pepo.training.models import tiny_qwen3

    model = tiny_qwen3(embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_dim=64, head_dim=16)
    assert cpu_attention_in_fp32(model) == 2
    assert cpu_attention_in_fp32(model) == 0
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(q.dtype) or sdpa(q, k, v, **kw))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    call = model.layers[0].attn._attention_call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(q, k, v, mask=None, dropout_p=0.0, is_causal=True)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout.to(torch.bfloat16))
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = _attention_ref(qr, kr, vr)
    ref.backward(gout.to(torch.bfloat16).double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    for x, r in ((q, qr), (k, kr), (v, vr)):
        assert x.grad.dtype == torch.bfloat16
        assert float((x.grad.double() - r.grad).norm() / r.grad.norm()) < 1e-2
    q32, k32, v32 = (x.detach().float() for x in (q, k, v))
    seen.clear()
    out32 = call(q32, k32, v32, mask=None, dropout_p=0.0, is_causal=True)
    assert seen == [torch.float32]
    assert torch.equal(out32, sdpa(q32, k32, v32, is_causal=True))


def test_fast_decoder_attention_in_fp32_on_a_cpu(model, monkeypatch):
    """The in-process decoder under bf16 autocast on a CPU runs its attention (the prompts'
    ``scaled_dot_product_attention`` and each step's score and value products) on fp32 inputs
    with autocast off, as the trainer's (:func:`cpu_attention_in_fp32`) — catches the decoder
    left in bf16 while the trainer's attention is fp32, a mismatch of the rollout/trainer gap —
    while its projections stay bf16; its log-probs match a trainer forward with fp32 attention
    to the bf16 body's error."""
    calls = []

    def recording(name, fn):
        def call(*a, **k):
            calls.append((name, a[0].dtype, torch.is_autocast_enabled("cpu")))
            return fn(*a, **k)
        return call

    for name in ("bmm", "baddbmm"):
        monkeypatch.setattr(torch, name, recording(name, getattr(torch, name)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        recording("sdpa", sdpa))
    seen, undo = _record_dtypes(model)
    try:
        engine = build_engine("inprocess", model, compute_dtype=torch.bfloat16)
        prompts = [[3, 4, 5, 6], [7, 8], [3, 4, 5, 6]]  # a prompt shared by two rows
        ro = engine.generate(prompts, max_new_tokens=5, pad_id=0, stop_tokens=[],
                             temperature=1.0, seeds=torch.arange(3))
        assert seen["body"] == {torch.bfloat16}
    finally:
        undo()
    assert {n for n, _, _ in calls} == {"sdpa", "bmm", "baddbmm"}
    assert {(d, on) for _, d, on in calls} == {(torch.float32, False)}, set(calls)
    monkeypatch.undo()
    trainer = copy.deepcopy(model)
    cpu_attention_in_fp32(trainer)
    with torch.no_grad(), autocast(CPU, torch.bfloat16):
        lp, _ = policy_logprobs(trainer, ro, torch.arange(3), chunk_size=4, temperature=1.0)
    gap = float((lp - ro.logprobs).abs()[ro.mask].max())
    assert gap < 5e-2, gap


def test_fast_plan_holds_its_fused_weights_in_autocasts_dtype(model):
    """Built under bf16 autocast, the fast decoder's plan holds its fused q/k/v and gate/up
    weights in bf16 (autocast caches its casts of the model's own parameters, not of these
    copies, so it would cast them again at every step), and decodes what a plan of fp32
    copies decodes under the same autocast, token for token and log-prob for log-prob
    (catches a cast to another dtype, or of the norms' scales, which stay fp32); built
    outside autocast, the copies stay fp32 (catches a cast made whatever the context), and a
    float64 model's stay float64, as autocast leaves float64 products alone (catches bf16
    weights beside float64 inputs, which fail)."""
    from pepo.training.fast_decoder import FastPlan
    from pepo.training.generation import decode

    plan32 = FastPlan.of(model)
    with autocast(CPU, torch.bfloat16):
        plan16 = FastPlan.of(model)
    for p, want in ((plan32, torch.float32), (plan16, torch.bfloat16)):
        assert all(f.qkv is not None and f.up is not None for f in p.fused)
        assert {f.qkv.dtype for f in p.fused} == {f.up.dtype for f in p.fused} == {want}
    norms = [f.head_norm if f.head_norm is not None else f.qk_norm for f in plan16.fused]
    assert all(n is not None and n.dtype == torch.float32 for n in norms)
    with autocast(CPU, torch.bfloat16):  # autocast casts no float64: nor does the plan
        plan64 = FastPlan.of(copy.deepcopy(model).double())
    assert {f.qkv.dtype for f in plan64.fused} == {f.up.dtype for f in plan64.fused} == {
        torch.float64}
    prompts = [[3, 4, 5, 6], [7, 8], [3, 4, 5, 6]]
    outs = []
    for p in (plan32, plan16):
        with autocast(CPU, torch.bfloat16):
            outs.append(decode([model], [p], prompts, max_new_tokens=6, pad_id=0,
                               stop_tokens=[], seeds=torch.arange(3), generator=None,
                               temperature=1.0, top_k=None, top_p=1.0))
    (_, _, tok32, lp32, valid32, _, _), (_, _, tok16, lp16, valid16, _, _) = outs
    assert torch.equal(tok32, tok16) and torch.equal(valid32, valid16)
    assert torch.equal(lp32, lp16)


def test_an_evaluation_without_parameters_to_train_gets_no_bf16_parameter_warning(monkeypatch):
    """``dtype`` is None where nothing is trained (``pepo_eval``): catches the
    bf16-parameters warning given for anything but fp32 (an evaluation told its parameters
    and optimizer state round away updates it never makes)."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("amx_bf16",))
    assert precision.cpu_warnings(None, None, CPU) == []
    assert precision.cpu_warnings(torch.bfloat16, None, CPU) == []
    (weights,) = precision.cpu_warnings(None, "bf16", CPU)
    assert weights.startswith("dtype=bf16 on a CPU")


def test_the_head_runs_outside_autocast_on_a_gpu_too():
    """``no_autocast`` turns autocast off for CUDA as for a CPU: catches a GPU run
    under ``compute_dtype: bf16`` whose output head makes bf16 logits (the rounding of its
    log-probs this module's docstring measures). Checked on the context itself, so that it runs
    without a GPU; with one, also by the logits' dtype."""
    ctx = precision.no_autocast(torch.device("cuda"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and not ctx._enabled
    cpu_ctx = precision.no_autocast(CPU)
    assert isinstance(cpu_ctx, torch.autocast) and cpu_ctx.device == "cpu"
    if torch.cuda.is_available():
        x = torch.randn(4, 8, device="cuda")
        w = torch.randn(8, 8, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (x @ w).dtype == torch.bfloat16
            with precision.no_autocast(torch.device("cuda")):
                assert (x @ w).dtype == torch.float32


def test_cpu_attention_runs_fp16_inputs_in_fp32_and_returns_fp16(monkeypatch):
    """The wrapper takes fp16 as it takes bf16 (a model loaded with ``dtype:
    fp16`` on a CPU): catches fp16 queries, keys and values passed to the CPU's attention as
    they are."""
    from pepo.training.models import tiny_qwen3

    model = tiny_qwen3(embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_dim=64, head_dim=16)
    assert cpu_attention_in_fp32(model) == 1
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(q.dtype) or sdpa(q, k, v, **kw))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g).to(torch.float16) for _ in range(3))
    out = model.layers[0].attn._attention_call(q, k, v, mask=None, dropout_p=0.0,
                                                is_causal=True)
    assert seen == [torch.float32] and out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _attention_ref(q, k, v), rtol=2e-3, atol=2e-3)


def test_the_precision_line_names_the_setting_when_it_was_not_auto(monkeypatch):
    """Only ``auto`` is explained by the CPU's units; a forced choice names the
    setting. Catches ``compute_dtype=fp32`` logged as "this CPU has amx_bf16" (as if auto had
    chosen), and ``bf16`` on a CPU without units logged as "no bf16 matrix units"."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("amx_bf16",))
    assert precision.describe("fp32", None, CPU) == (
        "matmuls in the parameters' dtype: compute_dtype=fp32")
    assert precision.describe("auto", torch.bfloat16, CPU) == (
        "matmuls in bf16 (autocast): this CPU has amx_bf16")
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ())
    assert precision.describe("bf16", torch.bfloat16, CPU) == (
        "matmuls in bf16 (autocast): compute_dtype=bf16")
    assert precision.describe("auto", None, torch.device("cuda")) == (
        "matmuls in the parameters' dtype: compute_dtype=auto")
