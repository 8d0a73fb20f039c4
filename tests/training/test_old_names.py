"""0.1's flat module names (``pepo.generation``, ``python -m pepo.analysis``, ...) still work in
0.2, with a FutureWarning naming the new place (``pepo._moved``)."""

import importlib
import subprocess
import sys
import warnings

from pepo._moved import MOVED


def test_old_module_names_warn_and_alias():
    """0.1's flat names still import (the moved module itself) with a FutureWarning."""
    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod = importlib.import_module(old)
        assert mod is importlib.import_module(new)
        assert mod.__spec__.name == new  # the moved module keeps its own spec
        assert any(issubclass(w.category, FutureWarning) and new in str(w.message) for w in caught)
        sys.modules.pop(old, None)


def test_old_analysis_command_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pepo.analysis", "--help"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pepo.analysis moved to pepo.study.analysis" in proc.stderr
    assert "usage:" in proc.stdout
