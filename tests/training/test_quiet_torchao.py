"""The recipe layer's one filter on what its dependencies print (collected with the recipe
extra)."""

from __future__ import annotations

import subprocess
import sys

from pepo import _extras


def test_the_torchao_abi_notice_is_kept_out_of_the_study_tools_output_and_nothing_else():
    """torchao 0.15.0 (the newest torchtune 0.6.1 works with) logs one line on every import
    with torch 2.13; the recipe-layer packages filter that line, and only it."""
    import logging

    code = ("import logging, pepo.study, torchao; "
            "logging.getLogger('torchao').warning('another torchao warning')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Skipping import of cpp extensions" not in out.stderr
    assert "another torchao warning" in out.stderr
    notice = logging.LogRecord("torchao", logging.WARNING, __file__, 1,
                               "Skipping import of cpp extensions due to incompatible torch "
                               "version 2.13.0+cpu for torchao version 0.15.0", None, None)
    assert not _extras._TorchaoAbiNotice().filter(notice)
