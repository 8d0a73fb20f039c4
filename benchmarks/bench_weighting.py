"""Speed and memory of pepo.weighting and pepo.entropy against their direct formulations.

Every ratio is measured in one run: the two implementations are timed alternately on the same
inputs, and the speed-up is the ratio of their medians. Peak memory is measured in a fresh
subprocess per (implementation, workload): on CUDA ``torch.cuda.max_memory_allocated``, on CPU
the peak resident memory (``VmHWM``, reset after the inputs are built) minus the resident
memory with the inputs alone. CPU figures need Linux's ``/proc``.

    python benchmarks/bench_weighting.py                # everything, CPU
    python benchmarks/bench_weighting.py --only weighting --repeats 5
    python benchmarks/bench_weighting.py --device cuda  # on a GPU
    python benchmarks/bench_weighting.py --device cuda --only weighting --no-memory --rounds 5
                                                        # and medians of 5 back-to-back rounds
    python benchmarks/bench_weighting.py --quick        # seconds: that it runs, no figures

Direct formulations (the baselines):
* windowed strategies: compact the valid tokens, reflect-pad by gathering, ``unfold`` into
  ``[B, T, W]`` and ``logsumexp`` (or ``mean``) over the window;
* ``global_topk``: ``torch.quantile`` of the valid scores, as TRL does (it refuses > 2^24);
* ``entropy_bonus``, ``uniform``: the one-line formula (a floor: they have nothing to speed up);
* ``logprobs_and_entropy``: ``log_softmax`` over the full ``[B, T, V]`` logits in fp32, with
  the entropy from ``softmax * log_softmax``; the hidden-state variant's baseline also
  materialises ``hidden @ weight.T``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Optional

import torch
from machine import cpu_name

import pepo.weighting as pw
from pepo.entropy import logprobs_and_entropy, logprobs_and_entropy_from_hidden

WINDOW = 101

# ------------------------------------------------------------------------------ workloads


def ragged_batch(b: int, t: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)  # ragged: 25%..100% of T
    mask = torch.arange(t)[None, :] < lengths[:, None]
    ent = torch.rand(b, t, generator=g) * 2.0
    adv = torch.randn(b, generator=g)
    return adv.to(device), ent.to(device), mask.to(device)


# ------------------------------------------------------------------------------ direct formulations


def _direct_windows(ent: torch.Tensor, mask: torch.Tensor,
                    window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact rows, reflect-pad by gather, unfold: ``[B, T, W]`` windows and compact values."""
    b, t = mask.shape
    half = window // 2
    lengths = mask.sum(1, keepdim=True)
    pos = mask.long().cumsum(1) - 1
    compact = torch.zeros(b, t + 1, device=ent.device).scatter_(
        1, torch.where(mask, pos, t), torch.where(mask, ent, 0.0)
    )[:, :t]
    j = torch.arange(-half, t + half, device=ent.device)[None, :]
    period = (2 * (lengths - 1)).clamp_min(1)
    j = torch.remainder(j, period)
    idx = torch.where(j > lengths - 1, period - j, j)
    padded = compact.gather(1, idx)  # [B, T + 2h]
    return padded.unfold(1, window, 1), compact  # [B, T, W] view; the ops below materialise it


def _expand(compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    return torch.where(mask, compact.gather(1, pos), 0.0)


def direct_proximal(ent, mask, window=WINDOW):
    win, compact = _direct_windows(ent, mask, window)
    return _expand(torch.exp(compact - torch.logsumexp(win, dim=-1)), mask)


def direct_proximal_softmax(adv, ent, mask):
    e = direct_proximal(ent, mask)
    c = e / e.sum(1, keepdim=True) * mask.sum(1, keepdim=True)
    return torch.where(mask, torch.where(adv[:, None] > 0, c * adv[:, None], adv[:, None]), 0.0)


def direct_window_average(adv, ent, mask):
    win, compact = _direct_windows(ent, mask, WINDOW)
    total = win.sum(-1)
    r = _expand(torch.where(total > 0, compact / total, 1.0 / WINDOW), mask)  # H / Σ_W H
    c = r / r.sum(1, keepdim=True) * mask.sum(1, keepdim=True)
    return torch.where(mask, torch.where(adv[:, None] > 0, c * adv[:, None], adv[:, None]), 0.0)


def _quantile_topk(adv, score, mask, fraction=0.2):
    thr = torch.quantile(score[mask], 1 - fraction)
    return torch.where(mask & (score >= thr), adv[:, None], 0.0)


def direct_global_topk(adv, ent, mask):
    return _quantile_topk(adv, ent, mask)


def direct_global_topk_proximal(adv, ent, mask):
    return _quantile_topk(adv, direct_proximal(ent, mask), mask)


def direct_entropy_bonus(adv, ent, mask):
    a = adv[:, None]
    return torch.where(mask, a + torch.minimum(0.4 * ent, a.abs() / 2.0), 0.0)


def direct_uniform(adv, ent, mask):
    return torch.where(mask, adv[:, None], 0.0)


def direct_gtpo(adv, ent, mask):  # no direct formulation to compare with: a dash
    return None


STRATEGIES: dict[str, tuple[Callable, Callable]] = {
    "uniform": (pw.get_strategy("uniform"), direct_uniform),
    "entropy_bonus": (pw.get_strategy("entropy_bonus"), direct_entropy_bonus),
    "global_topk": (pw.get_strategy("global_topk"), direct_global_topk),
    "global_topk(proximal)": (pw.get_strategy("global_topk", score="proximal"),
                              direct_global_topk_proximal),
    "window_average": (pw.get_strategy("window_average", window=WINDOW), direct_window_average),
    "proximal_softmax": (pw.get_strategy("proximal_softmax", window=WINDOW),
                         direct_proximal_softmax),
}


def naive_logprobs_entropy(logits, targets):
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V] fp32
    ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), ent.detach()


def naive_from_hidden(hidden, weight, targets):
    return naive_logprobs_entropy(hidden @ weight.t(), targets)


# ------------------------------------------------------------------------------ measurement


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_pair(fa: Callable[[], object], fb: Callable[[], object], repeats: int,
              device: str) -> tuple[float, float]:
    """Median seconds of ``fa`` and ``fb``, timed alternately after one warm-up each."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(repeats):
        for f, out in ((fa, ta), (fb, tb)):
            _sync(device)
            s = time.perf_counter()
            f()
            _sync(device)
            out.append(time.perf_counter() - s)
    return statistics.median(ta), statistics.median(tb)


def _entropy_workload(kind: str, device: str, b: int, t: int, v: int, d: int):
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, v, (b, t), generator=g).to(device)
    if kind == "logits":
        logits = (torch.randn(b, t, v, generator=g)).to(device).requires_grad_(True)
        return (logits,), targets
    hidden = (torch.randn(b, t, d, generator=g) / math.sqrt(d)).to(device).requires_grad_(True)
    weight = torch.randn(v, d, generator=g).to(device).requires_grad_(True)
    return (hidden, weight), targets


def _entropy_fns(kind: str, inputs, targets, chunk: int):
    def ours():
        fn = logprobs_and_entropy if kind == "logits" else logprobs_and_entropy_from_hidden
        lp, _ = fn(*inputs, targets, chunk_size=chunk)
        lp.sum().backward()

    def naive():
        fn = naive_logprobs_entropy if kind == "logits" else naive_from_hidden
        lp, _ = fn(*inputs, targets)
        lp.sum().backward()

    return ours, naive


def measure_memory(spec: dict) -> int:
    """Runs one measurement in a fresh interpreter; returns peak extra bytes."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def memory_child(spec: dict) -> None:
    device = spec["device"]
    torch.manual_seed(0)
    if spec["what"] == "strategy":
        adv, ent, mask = ragged_batch(spec["b"], spec["t"], device)
        fn = STRATEGIES[spec["name"]][0 if spec["impl"] == "ours" else 1]
        run = lambda: fn(adv, ent, mask)  # noqa: E731  # as the library runs it (on CUDA: Triton)
    else:
        inputs, targets = _entropy_workload(spec["kind"], device, spec["b"], spec["t"], spec["v"],
                                            spec["d"])
        ours, naive = _entropy_fns(spec["kind"], inputs, targets, spec["chunk"])
        run = ours if spec["impl"] == "ours" else naive
    if device.startswith("cuda"):
        run()  # a first call's compiling or autotuning is not the call's memory
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        print(torch.cuda.max_memory_allocated() - base)
    else:
        base = _rss_kib("VmRSS")
        _reset_peak_rss()
        run()
        print((_rss_kib("VmHWM") - base) * 1024)


def _rss_kib(field: str) -> int:
    """Current (VmRSS) or peak (VmHWM) resident memory of this process, in KiB (Linux)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0), so
    # the peak measures this workload, not the interpreter's start-up.
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def _mib(x: int) -> str:
    return f"{x / 2**20:,.0f} MiB"


def machine() -> str:
    return (
        f"{cpu_name()}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def bench_weighting(device: str, repeats: int, shapes: list[tuple[int, int]], memory: bool) -> None:
    print(f"\n## Weighting strategies (W = {WINDOW}, fp32, ragged lengths 25-100% of T, "
          f"{device})\n")
    print("| strategy | shape | pepo | direct | speed-up | peak extra mem pepo | direct |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for b, t in shapes:
        adv, ent, mask = ragged_batch(b, t, device)
        for name, (ours, direct) in STRATEGIES.items():
            # Same results first: the baseline is the same math.
            a, d = ours(adv, ent, mask), direct(adv, ent, mask)
            if name not in ("global_topk", "global_topk(proximal)"):
                torch.testing.assert_close(a, d, rtol=1e-4, atol=1e-5)
            t_ours, t_direct = time_pair(lambda: ours(adv, ent, mask),
                                         lambda: direct(adv, ent, mask), repeats, device)
            if memory:
                spec = {"what": "strategy", "name": name, "b": b, "t": t, "device": device}
                m_ours = _mib(measure_memory({**spec, "impl": "ours"}))
                m_direct = _mib(measure_memory({**spec, "impl": "direct"}))
            else:
                m_ours = m_direct = "-"
            print(
                f"| {name} | [{b}, {t}] | {t_ours * 1e3:.1f} ms | {t_direct * 1e3:.1f} ms | "
                f"{t_direct / t_ours:.1f}x | {m_ours} | {m_direct} |",
                flush=True,
            )


# ------------------------------------------------------------------------------ GPU: syncs, floor


def time_calls(fn: Callable[[], object], calls: int = 50, rounds: int = 5,
               host: bool = False) -> float:
    """Median over ``rounds`` of the mean seconds per call of ``calls`` back-to-back calls,
    timed with CUDA events: what a training loop sees, launches and host waits included
    (``host``, or no GPU: with the host's clock)."""
    fn()
    if host or not torch.cuda.is_available():  # the table's CPU rehearsal: host clock
        times = []
        for _ in range(rounds):
            s = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - s) / calls)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def time_synced(fn: Callable[[], object], calls: int = 15) -> float:
    """Median seconds of single calls, each between two device syncs (host clock): a call
    made alone, launch latency and host waits included."""
    fn()
    times = []
    for _ in range(calls):
        _sync("cuda" if torch.cuda.is_available() else "cpu")
        s = time.perf_counter()
        fn()
        _sync("cuda" if torch.cuda.is_available() else "cpu")
        times.append(time.perf_counter() - s)
    return statistics.median(times)


def count_syncs(fn: Callable[[], object]) -> int:
    """Host syncs of one call, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    if not torch.cuda.is_available():
        return -1
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


FAILED: set[str] = set()  # strategies whose kernel failed in this process


def mismatch(name: str, got: torch.Tensor, want: Optional[torch.Tensor]) -> str:
    """'' when a strategy's output matches its direct formulation, else what differs (the row
    reports it and the run goes on). ``global_topk`` may keep one token more or fewer than
    ``torch.quantile``'s fp32 threshold; with the proximal score its window sums differ from
    unfold's in the last bits, so ties at the threshold can split: that row is not compared."""
    if want is None or name == "global_topk(proximal)":
        return ""
    if name.startswith("global_topk"):
        differ = int((got != want).sum())
        return "" if differ <= 1 else f"MISMATCH: {differ} tokens differ from torch.quantile's"
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    except AssertionError as err:
        return "MISMATCH: " + " ".join(str(err).split())[:300]
    return ""


def bench_weighting_gpu(device: str, shapes: list[tuple[int, int]], calls: int) -> list[dict]:
    """Each strategy unvalidated (compiled, and as written), validated, and its direct
    formulation, against the read-once floor ``(H * mask).sum()``; host syncs per call."""
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else device
    print(f"\n## Weighting strategies on {gpu} (W = {WINDOW}, fp32, "
          f"ragged 25-100% of T; µs per call, mean of {calls} back-to-back calls, median of 5)"
          f"\n")
    print("| strategy | shape | floor | validate=False | ×floor | as written | validate=True | "
          "direct | direct/pepo | alone: floor / False / direct | syncs False / True / direct |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    rows = []
    for b, t in shapes:
        adv, ent, mask = ragged_batch(b, t, device)
        groups = torch.arange(b, device=device) // 8
        positive = adv > 0
        floor = time_calls(lambda: (ent * mask).sum(), calls)
        floor_alone = time_synced(lambda: (ent * mask).sum())
        for name, (ours, direct) in [*STRATEGIES.items(), ("gtpo", (pw.get_strategy("gtpo"),
                                                                     direct_gtpo))]:
            kw = {"positive": positive, "groups": groups}
            def unchecked():
                return ours(adv, ent, mask, validate=False, **kw)
            def checked():
                return ours(adv, ent, mask, **kw)
            d_fn = (lambda: direct(adv, ent, mask)) if direct(adv, ent, mask) is not None else None
            try:
                note = mismatch(name, unchecked(), d_fn() if d_fn else None)
            except Exception as err:  # its kernel failed (and falls back): the row says so
                note = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
                FAILED.add(name)  # later rounds would time the fallback
            if name in FAILED and not note:
                note = "FAILED in an earlier round (its kernel fell back)"
            if note:
                print(f"| {name} | [{b}, {t}] | {note} |", flush=True)
                rows.append({"strategy": name, "shape": [b, t], "failed": note})
                continue
            t_false = time_calls(unchecked, calls)
            was = pw.compile_enabled()
            pw.set_compile(False)
            t_eager = time_calls(unchecked, calls)
            pw.set_compile(was)
            t_true = time_calls(checked, calls)
            t_direct = time_calls(d_fn, calls) if d_fn else math.nan
            alone = (time_synced(unchecked), time_synced(d_fn) if d_fn else math.nan)
            syncs = (count_syncs(unchecked), count_syncs(checked),
                     count_syncs(d_fn) if d_fn else "-")
            row = {"strategy": name, "shape": [b, t], "floor_us": floor * 1e6,
                   "validate_false_us": t_false * 1e6, "as_written_us": t_eager * 1e6,
                   "validate_true_us": t_true * 1e6, "direct_us": t_direct * 1e6,
                   "syncs": syncs, "floor_alone_us": floor_alone * 1e6,
                   "validate_false_alone_us": alone[0] * 1e6, "direct_alone_us": alone[1] * 1e6}
            rows.append(row)
            direct_txt = "—" if d_fn is None else f"{t_direct * 1e6:,.0f}"
            ratio = "—" if d_fn is None else f"{t_direct / t_false:.2f}x"
            print(f"| {name} | [{b}, {t}] | {floor * 1e6:,.0f} | {t_false * 1e6:,.0f} | "
                  f"{t_false / floor:.1f} | {t_eager * 1e6:,.0f} | {t_true * 1e6:,.0f} | "
                  f"{direct_txt} | {ratio} | {floor_alone * 1e6:,.0f} / {alone[0] * 1e6:,.0f} / "
                  f"{alone[1] * 1e6:,.0f} | {syncs[0]} / {syncs[1]} / {syncs[2]} |",
                  flush=True)
    return rows


def print_medians(runs: list[list[dict]]) -> None:
    """Each strategy's median over back-to-back rounds of :func:`bench_weighting_gpu`: its
    unvalidated µs, ×floor and direct/pepo (each a per-round ratio), with their ranges."""
    def cell(values: list[float], fmt: str) -> str:
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return "—"
        return (f"{fmt.format(statistics.median(values))} "
                f"({fmt.format(min(values))}–{fmt.format(max(values))})")

    print(f"\n## Medians over {len(runs)} rounds (range in brackets)\n")
    print("| strategy | shape | floor µs | validate=False µs | ×floor | direct/pepo |")
    print("|---|---|---:|---:|---:|---:|")
    for i, row in enumerate(runs[0]):
        same = [r[i] for r in runs if "failed" not in r[i]]
        if not same:
            print(f"| {row['strategy']} | {row['shape']} | failed in every round | | | |")
            continue
        print(f"| {row['strategy']} | {row['shape']} | "
              f"{cell([r['floor_us'] for r in same], '{:,.0f}')} | "
              f"{cell([r['validate_false_us'] for r in same], '{:,.0f}')} | "
              f"{cell([r['validate_false_us'] / r['floor_us'] for r in same], '{:.1f}')} | "
              f"{cell([r['direct_us'] / r['validate_false_us'] for r in same], '{:.2f}')} |")


def bench_topk_large(device: str) -> None:
    n = 2**25
    b = 1024
    adv = torch.randn(b, device=device)
    ent = torch.rand(b, n // b, device=device)
    mask = torch.ones(b, n // b, dtype=torch.bool, device=device)
    s = pw.get_strategy("global_topk")
    s(adv, ent, mask)
    _sync(device)
    start = time.perf_counter()
    out = s(adv, ent, mask)
    _sync(device)
    took = time.perf_counter() - start
    try:
        torch.quantile(ent[mask], 0.8)
        quantile = "works"
    except RuntimeError as e:
        quantile = f"fails: {str(e).splitlines()[0][:60]}"
    # the exact rule: every token at or above the k-th largest score, k = N - ceil(0.8 (N - 1))
    k = n - math.ceil(0.8 * (n - 1))
    want = int((ent >= ent.flatten().sort(descending=True).values[k - 1]).sum())
    got = int((out != 0).sum())
    print(f"\n## global_topk on 2^25 = {n:,} tokens ({device})\n")
    exact = "exact" if got == want else f"NOT the exact {want:,}"
    print(f"selected {got:,} tokens in {took * 1e3:.0f} ms ({exact}); torch.quantile on the "
          f"same: {quantile}")


def bench_entropy(device: str, repeats: int, b: int, t: int, v: int, d: int, chunk: int,
                  memory: bool) -> None:
    print(f"\n## logprobs_and_entropy, forward + backward ({device}, chunk_size={chunk}; "
          f"{'the median of ' if repeats > 1 else ''}{repeats} timed run{'s' * (repeats > 1)} "
          f"each after a warm-up)\n")
    print("| function | work | pepo | naive | speed-up | peak extra mem pepo | naive |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in ("logits", "hidden"):
        inputs, targets = _entropy_workload(kind, device, b, t, v, d)
        ours, naive = _entropy_fns(kind, inputs, targets, chunk)
        t_ours, t_naive = time_pair(ours, naive, repeats, device)
        del inputs, targets
        if memory:
            spec = {"what": "entropy", "kind": kind, "b": b, "t": t, "v": v, "d": d,
                    "chunk": chunk, "device": device}
            m_ours = _mib(measure_memory({**spec, "impl": "ours"}))
            m_naive = _mib(measure_memory({**spec, "impl": "naive"}))
        else:
            m_ours = m_naive = "-"
        work = (f"logits [{b}, {t}, {v}]" if kind == "logits"
                else f"hidden [{b}, {t}, {d}] @ W [{v}, {d}]")
        name = "logprobs_and_entropy" if kind == "logits" else "..._from_hidden"
        print(
            f"| {name} | {work} | {t_ours:.2f} s | {t_naive:.2f} s | {t_naive / t_ours:.2f}x "
            f"| {m_ours} | {m_naive} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["weighting", "topk", "entropy"], default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--entropy-repeats", type=int, default=None,
                   help="logprobs_and_entropy's timed runs (default: a third of --repeats, at "
                        "least 1: each takes seconds on a CPU)")
    p.add_argument("--rounds", type=int, default=1,
                   help="GPU table: this many back-to-back rounds, then their medians")
    p.add_argument("--no-memory", action="store_true", help="skip the subprocess memory runs")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--entropy-batch", type=int, default=1,
                   help="B of the entropy workload (paper-scale: 4)")
    p.add_argument("--entropy-tokens", type=int, default=4096)
    p.add_argument("--hidden-dim", type=int, default=256, help="D of the hidden-state workload")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--quick", action="store_true",
                   help="a few seconds' check that everything runs: small workloads, 1 repeat, "
                        "no memory runs (the full run takes about 5 minutes and 12.5 GB of RAM "
                        "on a 2-core CPU)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--sync-table", action="store_true", help=argparse.SUPPRESS)  # CPU rehearsal
    args = p.parse_args()
    entropy_repeats = 1 if args.entropy_repeats is None else args.entropy_repeats
    if min(args.repeats, args.rounds, entropy_repeats) < 1:
        p.error(f"--repeats, --entropy-repeats and --rounds must be at least 1 (got "
                f"{args.repeats}, {entropy_repeats}, {args.rounds})")
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as e:  # an unknown device, or CUDA not there
        p.error(f"--device {args.device!r}: {str(e).splitlines()[0]}")
    if args.quick:
        args.repeats, args.no_memory = 1, True
        args.vocab, args.entropy_tokens = 4096, 512
    if args.entropy_repeats is None:
        args.entropy_repeats = max(1, args.repeats // 3)
    if args.memory_child:
        memory_child(json.loads(args.memory_child))
        return
    print(f"# pepo benchmark\n\nmachine: {machine()}")
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()}")
    memory = not args.no_memory
    if not args.quick and args.device == "cpu":
        print("(the full run takes about 5 minutes and 12.5 GB of RAM on a 2-core CPU; "
              "--quick checks that it runs in seconds)\n", flush=True)
    if args.only in (None, "weighting"):
        shapes = [(16, 512)] if args.quick else [(256, 4096), (32, 32768)]
        if args.device.startswith("cuda") or args.sync_table:
            runs, out = [], os.environ.get("PEPO_BENCH_JSON")
            with warnings.catch_warnings():  # a kernel that fails is a failed row, not a
                # fallback timed as if it were the kernel
                warnings.filterwarnings("error", message=r"strategy .*: .* failed",
                                        category=RuntimeWarning)
                for _ in range(max(1, args.rounds)):
                    runs.append(bench_weighting_gpu(args.device, shapes,
                                                    5 if args.quick else 50))
                    if out:  # after every round: a later failure keeps the earlier
                        with open(out, "w", encoding="utf-8") as f:
                            json.dump(runs[0] if len(runs) == 1 else runs, f, indent=1)
            if len(runs) > 1:
                print_medians(runs)
        if not args.device.startswith("cuda") or memory:  # on a GPU: for its memory columns
            bench_weighting(args.device, args.repeats, shapes, memory)
    if args.only in (None, "topk") and not args.quick:
        bench_topk_large(args.device)
    if args.only in (None, "entropy"):
        bench_entropy(
            args.device, args.entropy_repeats, args.entropy_batch, args.entropy_tokens,
            args.vocab, args.hidden_dim, args.chunk_size, memory,
        )


if __name__ == "__main__":
    main()
