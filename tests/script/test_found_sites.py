"""Where a host read is placed in the user's code: the standard library is skipped also under a virtual
environment, whose sys.prefix is not where the standard library lives (the GPU image: /opt/torch/.venv with the
standard library in /usr/lib/python3.12; its CUDA sync warnings were placed at warnings.py)."""

from __future__ import annotations

import importlib
import sys

from saturate.script.child import found


def test_under_a_venv_the_base_interpreters_standard_library_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    reloaded = importlib.reload(found)
    try:
        assert reloaded.is_stdlib("/usr/lib/python3.12/warnings.py")
        assert reloaded.is_stdlib(str(tmp_path / "venv" / "lib" / "python3.12" / "abc.py"))
        assert not reloaded.is_stdlib(str(tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "x.py"))
        assert not reloaded.is_stdlib("/usr/lib/python3/dist-packages/transformers/trainer.py")
        assert not reloaded.is_stdlib(str(tmp_path / "train.py"))
    finally:
        monkeypatch.undo()
        importlib.reload(found)

