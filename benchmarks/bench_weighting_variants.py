"""Where a GPU's time goes in pepo.weighting's strategies, unvalidated (``validate=False``).

Each strategy is timed as the library runs it (``torch.compile``, default mode), compiled with
CUDA graphs (``mode="reduce-overhead"``, its output cloned, since a graph's output is
overwritten by its next replay), and as written (no compile); ``global_topk``'s threshold also
from a full ``torch.sort`` instead of a ``topk`` of the shape's bound (its kernels find the
threshold by a radix select, or by a sort under ``PEPO_TOPK_SELECT=sort``). Strategies with
Triton kernels are also timed as their compiled bodies (what ``PEPO_TRITON=0`` runs). The first
table gives the fixed costs of this host: one eager op, one compiled call, one CUDA-graph
replay. Times are mean µs per call of 50 back-to-back calls, median of 5 rounds (CUDA events),
all in one run.

    python benchmarks/bench_weighting_variants.py              # on a GPU
    python benchmarks/bench_weighting_variants.py --quick      # that it runs (CPU: no graphs)
    python benchmarks/bench_weighting_variants.py --profile gtpo global_topk  # and their kernels

``--overhead`` times instead what a compiled call costs under other ``torch.compile`` settings
(guards kept on tensors only, no guards, the C++ wrapper): one kernel, and the strategies whose
calls are launch-bound.

``--host`` times, on the CPU, what the host pays around each unvalidated call (checks of the
arguments, the call's own Python) against the strategy's body alone, at a batch small enough
that its ops take a few µs: what separates a launch-bound GPU call from its kernels.

``--first-call`` times each compiled strategy's first call (its compilation) with the C++
wrapper and with Python's, each in a fresh process with an empty inductor cache: what a
training run pays once per strategy.

``--radix-blocks`` times, on a CUDA GPU with Triton, ``global_topk``'s radix select at other
histogram-pass settings (``PEPO_TOPK_HIST``: scores and warps a program) and with two passes
of 12 bits (``PEPO_TOPK_SELECT=radix12``) for three of a byte, one process per setting and
round, alternating over three rounds, each output checked equal to the default's: a pass's
GPU µs and the passes' number, the call's GPU µs (the profiler) and the calls' µs.

``--profile`` (``--profile-only``: nothing else) adds, for the strategies named, what
``torch.profiler`` sees in 20 unvalidated calls: kernel launches and GPU-busy µs per call
against the call's time, and the kernels that take the GPU's time (the first rows of the
profiler's table).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re

import torch
from bench_weighting import ragged_batch, time_calls
from machine import cpu_name

import pepo.weighting as pw

STRATEGIES = {
    "uniform": {},
    "entropy_bonus": {},
    "global_topk": {},
    "window_average": {"window": 101},
    "proximal_softmax": {"window": 101},
    "gtpo": {},
}
# what --profile can name: the strategies above, and global_topk with Table 3's proximal score
PROFILED = {**{name: (name, params) for name, params in STRATEGIES.items()},
            "global_topk(proximal)": ("global_topk", {"score": "proximal", "window": 101})}


def flagged_batch(b: int, t: int, device: str):
    """:func:`ragged_batch` and the keywords every strategy may read: success flags and groups
    of 8 rollouts."""
    adv, ent, mask = ragged_batch(b, t, device)
    return adv, ent, mask, {"positive": adv > 0,
                            "groups": torch.arange(b, device=device) // 8}


def topk_by_sort(adv, ent, mask, q: float = 0.8):
    """``global_topk``'s selection with the threshold read off a full descending sort."""
    n = mask.sum()
    k = n - torch.ceil((n - 1).double() * q).long()
    flat = torch.where(mask, ent.float(), -math.inf).reshape(-1)
    top = torch.sort(flat, descending=True).values
    thr = top.gather(0, (k - 1).clamp(0, flat.numel() - 1).reshape(1))
    return torch.where(mask & (ent >= thr) & (n > 0), adv[:, None], 0.0)


def bonus_eager_lean(adv, ent, mask, alpha: float = 0.4, kappa: float = 2.0):
    """``entropy_bonus`` in the fewest eager ops that keep its semantics (an inf entropy gives
    NaN, not the cap): ``cap + 0 * H`` is NaN exactly where ``H`` is inf."""
    cap = (adv.abs() / kappa)[:, None]
    bonus = torch.minimum(ent * alpha, torch.addcmul(cap, ent, torch.zeros((), device=ent.device)))
    return torch.where(mask, adv[:, None] + bonus, 0.0)


def graphed(fn):
    """``fn`` compiled with CUDA graphs; each call starts a new step and clones the output."""
    compiled = torch.compile(fn, dynamic=True, mode="reduce-overhead")

    def call(*args, **kwargs):
        if torch.cuda.is_available():
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs).clone()

    return call


def profile_calls(fn, calls: int = 20) -> tuple[float, float, str]:
    """Kernel launches and GPU-busy µs per call of ``fn`` (``torch.profiler``, ``calls`` calls
    after one warm-up), and the profiler's table of the busiest kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if "LaunchKernel" in e.key) / calls
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in ka
               if str(getattr(e, "device_type", "")).endswith("CUDA")) / calls
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return launches, busy, ka.table(sort_by=key, row_limit=12)


COMPILE_OPTIONS = {
    "default (the library's)": {},
    "tensor guards only": {"guard_filter_fn": "keep_tensor_guards_unsafe"},
    "no guards": {"guard_filter_fn": "skip_all_guards_unsafe"},
    "C++ wrapper": {"cpp_wrapper": True},
}


def compiled_with(fn, option: dict, filtered: list):
    """``torch.compile(fn, dynamic=True)`` with one of :data:`COMPILE_OPTIONS`; a guard filter
    appends to ``filtered`` each time Dynamo consults it (it does only while compiling a frame
    anew: after :func:`torch._dynamo.reset`, not where a frame compiled under another setting
    is cached)."""
    opts = {}
    for k, v in option.items():
        if k == "guard_filter_fn":
            def counted(entries, f=getattr(torch.compiler, v)):
                filtered.append(len(entries))
                return f(entries)
            opts[k] = counted
        else:
            opts[k] = v
    return torch.compile(fn, dynamic=True, options=opts or None)


def overhead(device: str, calls: int, shapes: list) -> list[dict]:
    """One compiled kernel's call, and the launch-bound strategies' compiled bodies, under each
    of :data:`COMPILE_OPTIONS`, each compiled afresh (Dynamo reset before each: a frame
    compiled under an earlier setting would be reused, its guards with it, and without guards
    one strategy's compiled ``_body`` runs for the next); each checked against the library's
    output, and a guard filter checked to have been consulted."""
    rows = []
    x = torch.randn(256, 4096, device=device)
    print("\n| compile setting | one kernel | " + " | ".join(
        f"{n} [{b}, {t}]" for b, t in shapes for n in ("gtpo", "global_topk", "proximal_softmax"))
        + " |\n|---|---:|" + "---:|" * (3 * len(shapes)))
    batches = [flagged_batch(b, t, device) for b, t in shapes]
    for label, option in COMPILE_OPTIONS.items():
        try:
            torch._dynamo.reset()
            filtered: list = []
            one = compiled_with(lambda t: t + 3, option, filtered)
            cells = [time_calls(lambda: one(x), calls)]
            for adv, ent, mask, kw in batches:
                for name in ("gtpo", "global_topk", "proximal_softmax"):
                    s = pw.get_strategy(name, **STRATEGIES[name])
                    k = {key: kw[key] for key, wanted in (("positive", s.reads_positive),
                                                          ("groups", s.needs_groups)) if wanted}
                    want = s(adv, ent, mask, validate=False, **kw)
                    torch._dynamo.reset()  # without guards one strategy's frame runs another's
                    body = compiled_with(s._body, option, filtered)
                    torch.testing.assert_close(body(adv, ent, mask, **k), want)
                    cells.append(time_calls(lambda: body(adv, ent, mask, **k), calls))
            if "guard_filter_fn" in option and not filtered:
                raise RuntimeError("the guard filter was never consulted: not this setting")
        except Exception as err:  # report, go on
            print(f"({label}: {type(err).__name__}: {str(err)[:160]})")
            continue
        rows.append({"compile_setting": label, "us": [c * 1e6 for c in cells],
                     "guard_filter_calls": len(filtered)})
        print(f"| {label} | " + " | ".join(f"{c * 1e6:,.0f}" for c in cells) + " |", flush=True)
    return rows


def first_call_child(name: str) -> None:
    """Prints the first and the second call's seconds of ``name`` (unvalidated), as JSON."""
    import time

    device = "cuda" if torch.cuda.is_available() else "cpu"
    adv, ent, mask, kw = flagged_batch(256, 4096, device)
    s = pw.get_strategy(name, **STRATEGIES.get(name, {}))
    times = []
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        s(adv, ent, mask, validate=False, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"first_s": times[0], "second_s": times[1]}))


def first_calls(names: list[str]) -> list[dict]:
    """:func:`first_call_child` for each strategy and wrapper, in fresh processes."""
    import subprocess
    import sys
    import tempfile

    rows = []
    print("\n| strategy | wrapper | first call s | second call µs |\n|---|---|---:|---:|")
    for name in names:
        for cpp in ("1", "0"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PEPO_COMPILE_CPP": cpp,
                       "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
                done = subprocess.run([sys.executable, os.path.abspath(__file__),
                                       "--first-call-child", name], env=env, text=True,
                                      capture_output=True, timeout=600)
            if done.returncode != 0:
                print(f"({name}: {done.stderr.strip().splitlines()[-1:]})")
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            label = "C++" if cpp == "1" else "Python"
            rows.append({"strategy": name, "wrapper": label, **got})
            print(f"| {name} | {label} | {got['first_s']:.1f} | {got['second_s'] * 1e6:,.0f} |",
                  flush=True)
    return rows


def host_costs(calls: int, rounds: int) -> list[dict]:
    """What the host pays around each strategy's unvalidated call, on a CPU batch of [8, 16]:
    the call with its body replaced by one returning a ready tensor (the arguments' checks and
    the call's own Python, nothing else), as a training loop makes it (``positive`` and
    ``groups`` passed) and with neither (``gtpo``: groups only); then ``uniform`` whole against
    its direct formulation, ``torch.where(mask, adv[:, None], 0.0)``, and its body alone. µs
    per call: the mean of ``calls`` calls, the median of ``rounds`` (host clock, also where a
    GPU is present). A CUDA call also passes through the kernel's fallback guard, which a CPU
    call skips: its cost around the kernels is a little more."""
    adv, ent, mask, kw = flagged_batch(8, 16, "cpu")
    ready = torch.zeros(8, 16)
    print(f"\n## Host cost around an unvalidated call, [8, 16] on the CPU (µs; mean of {calls} "
          f"calls, median of {rounds})\n\n{cpu_name()}, torch {torch.__version__}\n")
    print("| strategy | around the body: positive and groups passed | neither passed |")
    print("|---|---:|---:|")
    rows = []
    for name, params in STRATEGIES.items():
        s = pw.get_strategy(name, **params)
        s._body = lambda *a, **k: ready  # the instance's body: the wrapper's cost alone
        bare = {"groups": kw["groups"]} if s.needs_groups else {}
        times = [time_calls(f, calls, rounds, host=True) * 1e6 for f in (
            lambda: s(adv, ent, mask, validate=False, **kw),
            lambda: s(adv, ent, mask, validate=False, **bare))]
        rows.append({"host_strategy": name, "wrapper_us": times[0], "wrapper_bare_us": times[1]})
        print(f"| {name} | {times[0]:.2f} | {times[1]:.2f} |", flush=True)
    s = pw.get_strategy("uniform")
    torch.testing.assert_close(s(adv, ent, mask, validate=False),
                               torch.where(mask, adv[:, None], 0.0), rtol=0, atol=0)
    whole = {"call, positive and groups": lambda: s(adv, ent, mask, validate=False, **kw),
             "call, neither": lambda: s(adv, ent, mask, validate=False),
             "body alone": lambda: s._body(adv, ent, mask),
             "direct: torch.where(mask, adv[:, None], 0.0)":
                 lambda: torch.where(mask, adv[:, None], 0.0)}
    print("\nuniform, whole calls:\n")
    for label, f in whole.items():
        t = time_calls(f, calls, rounds, host=True) * 1e6
        rows.append({"host_uniform": label, "us": t})
        print(f"- {label}: {t:.2f} µs", flush=True)
    return rows


# PEPO_TOPK_HIST values, with three passes of a byte ("radix", the default's, first) or two
# of 12 bits ("radix12/..."); --radix-blocks names others (1024x4 was the default before)
RADIX_SETTINGS = ["4096x8", "8192x8", "radix12/4096x8", "radix12/2048x8"]


def radix_env(setting: str) -> dict:
    """A ``RADIX_SETTINGS`` entry as the environment it runs under; ``ValueError`` naming a
    setting that is none."""
    select, _, hist = setting.rpartition("/")
    if select not in ("", "radix", "radix12") or not re.fullmatch(r"\d+x\d+", hist):
        raise ValueError(f"--radix-blocks {setting}: expected BLOCKxWARPS, or "
                         f"radix12/BLOCKxWARPS for two 12-bit passes (e.g. 4096x8)")
    return {"PEPO_TOPK_SELECT": select or "radix", "PEPO_TOPK_HIST": hist}


def radix_child(setting: str, out: str, calls: int, shapes: list) -> None:
    """In a process of its own, under ``setting``'s environment: ``global_topk`` (entropy and
    proximal score) timed and profiled at each shape; its outputs saved beside the figures."""
    from torch.profiler import ProfilerActivity, profile

    assert all(os.environ.get(k) == v for k, v in radix_env(setting).items())
    rows, outputs = [], {}
    for b, t in shapes:
        adv, ent, mask = ragged_batch(b, t, "cuda")
        floor = time_calls(lambda: (ent * mask).sum(), calls)
        for score in ("entropy", "proximal"):
            s = pw.get_strategy("global_topk", score=score, window=101)
            fn = lambda: s(adv, ent, mask, validate=False)  # noqa: E731
            outputs[f"{score} {b}x{t}"] = fn().cpu()
            call = time_calls(fn, calls)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            events = prof.key_averages()
            (passes,) = [e for e in events if e.key == "radix_hist_kernel"]
            rows.append({"setting": setting, "score": score, "shape": [b, t],
                         "floor_us": floor * 1e6, "call_us": call * 1e6,
                         "pass_us": passes.device_time_total / passes.count,
                         "passes": passes.count / 20,
                         "gpu_us": sum(getattr(e, "self_device_time_total", 0.0)
                                       for e in events) / 20})
    torch.save(outputs, out + ".pt")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(rows, f)


def radix_blocks(quick: bool, settings: list[str]) -> list[dict]:
    """``global_topk``'s radix select at each of ``settings`` (``RADIX_SETTINGS`` entries): one
    process per setting and round, alternating (three rounds; one with ``quick``, whose
    children run ``--quick`` too); every output checked equal to the first setting's."""
    import statistics
    import subprocess
    import sys
    import tempfile

    got: dict[tuple, list[dict]] = {}
    rounds = 1 if quick else 3
    files = {s: s.replace("/", "-") for s in settings}  # a setting's files' name
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for setting in settings:
                out = os.path.join(tmp, f"{files[setting]}-{r}.json")
                subprocess.run([sys.executable, __file__, "--radix-child", setting, "--out", out,
                                *["--quick"] * quick], check=True,
                               env={**os.environ, **radix_env(setting)})
                with open(out, encoding="utf-8") as f:
                    for row in json.load(f):
                        got.setdefault((row["score"], tuple(row["shape"]), setting), []).append(row)
        want = torch.load(os.path.join(tmp, f"{files[settings[0]]}-0.json.pt"))
        for r in range(rounds):
            for setting in settings:
                for key, value in torch.load(os.path.join(
                        tmp, f"{files[setting]}-{r}.json.pt")).items():
                    assert torch.equal(value, want[key]), f"{key} differs at {setting}"
    print("| score | shape | floor µs | " + " | ".join(settings) + " |")
    print("|---|---|---:|" + "---:|" * len(settings))
    rows: list[dict] = []
    for score, shape in dict.fromkeys((k[0], k[1]) for k in got):
        cells, floors = [], []
        for setting in settings:
            runs = got[(score, shape, setting)]
            med = {k: statistics.median(x[k] for x in runs)
                   for k in ("pass_us", "passes", "gpu_us", "call_us", "floor_us")}
            floors.append(med["floor_us"])
            rows.append({"radix_blocks": setting, "score": score, "shape": list(shape), **med})
            cells.append(f"{med['pass_us']:.1f}×{med['passes']:g} / {med['gpu_us']:,.0f} / "
                         f"{med['call_us']:,.0f}")
        print(f"| {score} | {list(shape)} | {statistics.median(floors):,.0f} | "
              + " | ".join(cells) + " |", flush=True)
    print("\n(a histogram pass's GPU µs × the passes / the call's GPU µs / the call's µs, "
          f"medians over the rounds; every output equal to {settings[0]}'s)")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.add_argument("--overhead", action="store_true",
                   help="only the compile settings' call costs (see the module's docstring)")
    p.add_argument("--host", action="store_true",
                   help="only the host's cost around each call, on the CPU (see host_costs)")
    p.add_argument("--first-call", nargs="*", default=None, metavar="STRATEGY",
                   help="only the first calls' compile times of these strategies")
    p.add_argument("--first-call-child", help=argparse.SUPPRESS)
    p.add_argument("--radix-blocks", nargs="*", default=None, metavar="SETTING",
                   help="only global_topk's radix passes at these settings (a CUDA GPU): "
                        "PEPO_TOPK_HIST values, radix12/ before one for two 12-bit passes "
                        f"(default: {' '.join(RADIX_SETTINGS)}; the first is the reference)")
    p.add_argument("--radix-child", help=argparse.SUPPRESS)
    p.add_argument("--profile", nargs="*", default=[], metavar="STRATEGY",
                   choices=list(PROFILED),
                   help="also profile these strategies' unvalidated calls")
    p.add_argument("--profile-only", action="store_true",
                   help="only the profiles (no fixed costs, no table)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(16, 512)] if args.quick else [(256, 4096), (32, 32768)]
    calls = 5 if args.quick else 50
    rows: list[dict] = []

    def save():
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)

    if args.first_call_child:
        first_call_child(args.first_call_child)
        return
    if args.first_call is not None:
        rows.extend(first_calls(args.first_call or ["proximal_softmax", "gtpo", "global_topk"]))
        save()
        return
    if args.host:
        rows.extend(host_costs(200 if args.quick else 20_000, 3 if args.quick else 7))
        save()
        return
    if args.radix_child:
        radix_child(args.radix_child, args.out, calls, shapes)
        return
    if args.radix_blocks is not None:
        for setting in args.radix_blocks:
            try:
                radix_env(setting)
            except ValueError as e:
                raise SystemExit(str(e)) from None
        if device != "cuda" or importlib.util.find_spec("triton") is None:
            raise SystemExit("--radix-blocks times Triton kernels: it needs a CUDA GPU and "
                             "Triton")
        rows.extend(radix_blocks(args.quick, args.radix_blocks or RADIX_SETTINGS))
        save()
        return
    if args.overhead:
        rows.extend(overhead(device, calls, shapes))
        save()
        return
    if not args.profile_only:  # the fixed costs and the table
        x = torch.randn(256, 4096, device=device)
        one = torch.compile(lambda t: t + 1, dynamic=True)
        one_static = torch.compile(lambda t: t + 2, dynamic=False)
        fixed = {"eager op": time_calls(lambda: x + 1, calls),
                 "compiled call (one kernel)": time_calls(lambda: one(x), calls),
                 "compiled call, static shapes (one kernel)":
                     time_calls(lambda: one_static(x), calls)}
        if device == "cuda":
            g1 = graphed(lambda t: t + 1)
            fixed["CUDA-graph replay (one kernel, then the clone)"] = time_calls(
                lambda: g1(x), calls)
        print(f"# fixed costs on {torch.cuda.get_device_name() if device == 'cuda' else device}\n")
        for k, v in fixed.items():
            print(f"- {k}: {v * 1e6:,.1f} µs")
        rows.append({"fixed_us": {k: v * 1e6 for k, v in fixed.items()}})
        save()
        print("\n| strategy | shape | floor | library (compiled) | CUDA graphs | as written | sort "
              "threshold: eager / compiled (global_topk); lean eager, direct (entropy_bonus); "
              "torch.compile (those with a Triton kernel) |")
        print("|---|---|---:|---:|---:|---:|---|")
        for b, t in shapes:
            adv, ent, mask, kw = flagged_batch(b, t, device)
            floor = time_calls(lambda: (ent * mask).sum(), calls)
            for name, params in STRATEGIES.items():
                s = pw.get_strategy(name, **params)
                lib = time_calls(lambda: s(adv, ent, mask, validate=False, **kw), calls)
                was = pw.compile_enabled()
                pw.set_compile(False)
                eager = time_calls(lambda: s(adv, ent, mask, validate=False, **kw), calls)
                try:
                    g = graphed(lambda a, e, m, **k: s(a, e, m, validate=False, **k))
                    want = s(adv, ent, mask, validate=False, **kw)
                    torch.testing.assert_close(g(adv, ent, mask, **kw), want)
                    cg = time_calls(lambda: g(adv, ent, mask, **kw), calls)
                except Exception as err:  # report, go on
                    print(f"({name}: CUDA graphs failed: {type(err).__name__}: {str(err)[:120]})")
                    cg = math.nan
                pw.set_compile(was)
                sort_txt, sorts, extra = "", (math.nan, math.nan), {}
                if name == "entropy_bonus":  # the lean eager formula against the library's
                    want = s(adv, ent, mask, validate=False)
                    torch.testing.assert_close(bonus_eager_lean(adv, ent, mask), want)
                    lean = time_calls(lambda: bonus_eager_lean(adv, ent, mask), calls)
                    direct = time_calls(lambda: torch.where(
                        mask, adv[:, None] + torch.minimum(0.4 * ent, adv[:, None].abs() / 2.0),
                        0.0),
                        calls)
                    sort_txt = f"lean eager {lean * 1e6:,.0f}, direct {direct * 1e6:,.0f}"
                    extra.update(lean_eager_us=lean * 1e6, direct_us=direct * 1e6)
                if s._triton is not None and device == "cuda":  # its kernel against what
                    body = torch.compile(s._body, dynamic=True)  # PEPO_TRITON=0 runs instead
                    kb = {k: v for k, v in kw.items()  # the keywords its body takes
                          if (k == "positive" and s.reads_positive)
                          or (k == "groups" and s.needs_groups)}
                    want = s(adv, ent, mask, validate=False, **kw)
                    torch.testing.assert_close(body(adv, ent, mask, **kb), want, rtol=2e-5,
                                               atol=1e-6)
                    compiled = time_calls(lambda: body(adv, ent, mask, **kb), calls)
                    sort_txt += (", " if sort_txt else "") + (
                        f"torch.compile {compiled * 1e6:,.0f} (library: Triton)")
                    extra["torch_compile_us"] = compiled * 1e6
                if name == "global_topk":
                    want = s(adv, ent, mask, validate=False)
                    assert torch.equal(topk_by_sort(adv, ent, mask), want)
                    compiled_sort = torch.compile(topk_by_sort, dynamic=True)
                    sorts = (time_calls(lambda: topk_by_sort(adv, ent, mask), calls),
                             time_calls(lambda: compiled_sort(adv, ent, mask), calls))
                    sort_txt = (f"{sorts[0] * 1e6:,.0f} / {sorts[1] * 1e6:,.0f}"
                                + (", " if sort_txt else "") + sort_txt)
                rows.append({"strategy": name, "shape": [b, t], "floor_us": floor * 1e6,
                             "library_us": lib * 1e6, "cuda_graphs_us": cg * 1e6,
                             "as_written_us": eager * 1e6, "sort_eager_us": sorts[0] * 1e6,
                             "sort_compiled_us": sorts[1] * 1e6, **extra})
                save()
                print(f"| {name} | [{b}, {t}] | {floor * 1e6:,.0f} | {lib * 1e6:,.0f} | "
                      f"{cg * 1e6:,.0f} | {eager * 1e6:,.0f} | {sort_txt} |", flush=True)
    for b, t in shapes if args.profile else []:
        adv, ent, mask, kw = flagged_batch(b, t, device)
        for name in args.profile:
            base, params = PROFILED[name]
            s = pw.get_strategy(base, **params)
            fn = lambda: s(adv, ent, mask, validate=False, **kw)  # noqa: E731
            t_call = time_calls(fn, calls)
            launches, busy, table = profile_calls(fn)
            rows.append({"profile": name, "shape": [b, t], "call_us": t_call * 1e6,
                         "launches_per_call": launches, "gpu_busy_us_per_call": busy})
            save()
            print(f"\n### {name} [{b}, {t}]: {t_call * 1e6:,.0f} µs a call, {launches:.1f} "
                  f"kernel launches, GPU busy {busy:,.0f} µs\n\n{table}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    main()
