"""pepo._triton's kernels compile for the GPUs users train on, on a machine without one.

Triton compiles ahead of time for a named target (its own LLVM and the ``ptxas`` its wheel
ships): every kernel, at every compile-time switch and every entropy dtype it reads, down to
a cubin for the H100/H200 (sm_90) and the A100 (sm_80). This catches what Triton's interpreter
(``tests/test_triton_kernels.py`` on a CPU) lets through: a type that changes across a loop, a
construct the compiler rejects, an op without a lowering for a dtype; and, from ``ptxas -v``,
a kernel that spills registers to local memory on sm_90 at the warps it launches with (a
4,096-bin ``tl.histogram`` took 255 registers and spilled 1 KB a thread). Collected where Triton
is installed and ``TRITON_INTERPRET`` is not set (the interpreter replaces the compiled
kernels).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pepo import _triton  # noqa: E402

ENT = ["*fp32", "*bf16", "*fp16", "*fp64"]  # the entropies' dtypes a strategy accepts
# (kernel, pointer and float argument types (other arguments are i32), compile-time switches)
KERNELS = [
    *[("_entropy_bonus_kernel", {"adv_ptr": "*fp32", "ent_ptr": e, "mask_ptr": "*i1",
                                 "out_ptr": "*fp32", "alpha": "fp32", "inv_kappa": "fp32"},
       {"BLOCK": 1024}) for e in ENT],
    # ZERO: global_topk's counts zeroed (2 for the sort's, 2,048 for the radix select's 1,026,
    # 16,384 for radix12's 8,450)
    *[("_compact_kernel", {"ent_ptr": e, "mask_ptr": "*i1", "x_ptr": "*fp32", "pos_ptr": "*i32",
                           "len_ptr": "*i32", "stat_ptr": "*fp32",
                           "count_ptr": "*i32" if zero == 0 else "*i64", "scale": "fp32"},
       {"PROXIMAL": proximal, "ZERO": zero, "BLOCK": 1024, "CHUNK": 2048})
      for e in ENT for proximal, zero in ((True, 0), (False, 0), (True, 2), (True, 2048),
                                          (True, 16384))],
    *[("_window_kernel", {"x_ptr": "*fp32", "pos_ptr": "*i32", "len_ptr": "*i32",
                          "stat_ptr": "*fp32", "mask_ptr": "*i1", "e_ptr": "*fp32",
                          "part_ptr": "*fp32", "count_ptr": "*i32" if topk == 0 else "*i64",
                          "inv_w": "fp32", "scale": "fp32", "wide_range": "fp32"},
       {"PROXIMAL": proximal, "TOPK": topk, "TILE": 256})
      for proximal, topk in ((True, 0), (False, 0), (True, 1), (True, 2))],
    *[("_weight_kernel", {"e_ptr": "*fp32", "part_ptr": "*fp32", "len_ptr": "*i32",
                          "adv_ptr": "*fp32", "pos_flag_ptr": "*fp32" if all_rows else "*i1",
                          "mask_ptr": "*i1", "out_ptr": "*fp32"},
       {"ALL_ROWS": all_rows, "TILE": 256}) for all_rows in (True, False)],
    *[("_topk_prep_kernel", {"s_ptr": e, "mask_ptr": "*i1", "flat_ptr": "*fp32",
                             "count_ptr": "*i64"}, {"RADIX": radix, "BLOCK": 1024})
      for e in ENT for radix in (False, True)],
    *[("_radix_hist_kernel", {"flat_ptr": "*fp32", "count_ptr": "*i64", "q_bits": bits},
       {"PASS": p, "DIGIT": digit, "BLOCK": _triton._HIST_BLOCK})
      for digit, p in ((8, 1), (8, 2), (8, 3), (12, 1), (12, 2)) for bits in ("i64", "i32")],
    *[("_topk_radix_apply_kernel", {"flat_ptr": "*fp32", "count_ptr": "*i64",
                                    "adv_ptr": "*fp32", "mask_ptr": "*i1", "out_ptr": "*fp32",
                                    "q_bits": bits},
       {"SELECTED": selected, "DIGIT": digit, "BLOCK": 1024})
      for selected in (True, False) for bits in ("i64", "i32") for digit in (8, 12)],
    # a float64 argument travels as its bits: an i64, or an i32 where they fit (q = 0.0)
    *[("_topk_apply_kernel", {"flat_ptr": "*fp32", "ordered_ptr": "*fp32", "count_ptr": "*i64",
                              "adv_ptr": "*fp32", "mask_ptr": "*i1", "out_ptr": "*fp32",
                              "q_bits": bits}, {"SELECTED": selected, "BLOCK": 1024})
      for selected in (True, False) for bits in ("i64", "i32")],
    *[("_gtpo_rows_kernel", {"ent_ptr": e, "mask_ptr": "*i1", "pos_flag_ptr": "*i1",
                             "group_ptr": g, "x_ptr": "*fp64", "pos_ptr": "*i32",
                             "len_ptr": "*i32", "side_ptr": "*i32", "group_list_ptr": "*i32",
                             "count_ptr": "*i32", "eps_bits": "i64"}, {"BLOCK": 1024})
      for e in ENT for g in ("*i64", "*i32")],
    *[("_gtpo_shape_kernel", {"x_ptr": "*fp64", "pos_ptr": "*i32", "len_ptr": "*i32",
                              "side_ptr": "*i32", "count_ptr": "*i32", "pos_flag_ptr": "*i1",
                              "mask_ptr": "*i1", "r_ptr": "*fp64", "part_ptr": "*fp64",
                              "alpha1_bits": bits, "alpha2_bits": "i64"},
       {"SIDE": side, "TILE": 256}) for side in (True, False) for bits in ("i64", "i32")],
    *[("_gtpo_standardize_kernel", {"r_ptr": "*fp64", "part_ptr": "*fp64", "len_ptr": "*i32",
                                    "list_ptr": "*i32", "count_ptr": "*i32", "mask_ptr": "*i1",
                                    "pos_flag_ptr": "*i1", "out_ptr": "*fp32",
                                    "alpha_bits": "i64"}, {"SIDE": side, "TILE": 256})
      for side in (True, False)],
]


def test_every_kernel_is_listed():
    """A kernel added to pepo._triton without a line here would never be compiled by CI."""
    kernels = {name for name in dir(_triton) if name.endswith("_kernel")
               and isinstance(getattr(_triton, name), triton.runtime.JITFunction)}
    assert kernels == {name for name, _, _ in KERNELS}


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("name,types,switches", KERNELS, ids=[
    "-".join([k[0], *map(str, k[2].values()),
              *(t for a, t in k[1].items() if t in ENT or a.endswith("bits"))])
    for k in KERNELS])
def test_kernel_compiles_for_the_gpu(arch, name, types, switches):
    fn = getattr(_triton, name)
    assert set(types) | set(switches) <= set(fn.arg_names)  # no misspelt argument
    signature = {a: "constexpr" if a in switches else types.get(a, "i32") for a in fn.arg_names}
    constexprs = {(fn.arg_names.index(a),): v for a, v in switches.items()}
    # the warps it launches with (the radix passes take 8; the others Triton's default 4)
    warps = _triton._HIST_WARPS if name == "_radix_hist_kernel" else 4
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"]  # ptxas accepted the kernel
    if arch == 90:  # and fits a thread's registers there (radix12's 4,096-bin histogram did not)
        assert "0 bytes spill stores" in _ptxas_report(compiled.asm["ptx"], "sm_90a")


def _ptxas_report(ptx: str, arch: str) -> str:
    """``ptxas -v``'s lines on a kernel's registers and spills (the ptxas Triton compiles with)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx, encoding="utf-8")
        out = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"-arch={arch}", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True)
    return out.stderr
