"""A stopped run's temporary files go with its run folder (`script/scratch.scratch_tmp`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from saturate.script.scratch import PYMP_LISTENER, SOCKET_PATH_MAX, scratch_tmp


def test_a_stopped_runs_temporary_folder_is_inside_its_run_folder_and_compiled_kernels_stay_cached():
    folder = Path(tempfile.mkdtemp(prefix="sat-"))
    try:
        env = scratch_tmp(folder, {})
        assert env["TMPDIR"] == str(folder / "tmp") and (folder / "tmp").is_dir()
        assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == Path(tempfile.gettempdir())  # torch's default, kept
        assert scratch_tmp(folder, {"TORCHINDUCTOR_CACHE_DIR": "/x/cache"})["TORCHINDUCTOR_CACHE_DIR"] == "/x/cache"
    finally:
        os.rmdir(folder / "tmp")
        os.rmdir(folder)


def test_a_run_folder_too_deep_for_a_workers_socket_keeps_the_temporary_folder_as_it_was(tmp_path):
    deep = tmp_path / ("d" * max(1, SOCKET_PATH_MAX - len(str(tmp_path)) - len(PYMP_LISTENER)))
    deep.mkdir()
    assert scratch_tmp(deep, {}) == {} and not (deep / "tmp").exists()
