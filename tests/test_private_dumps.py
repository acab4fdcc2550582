"""M26 item 4: expert-distribution dumps are private (they hold request ids and routing).

The real recorder dumps into the default directory (under $XDG_CACHE_HOME, made 0700 even
when it existed wider) and into a configured one; every file is 0600 whatever the umask.
The shipped default of the old code (/tmp, files 0644 by the umask) fails these.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import TEST_MODEL_PATH


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def recorder_dir_default() -> str | None:
    # The configured default of the server (None once server_args no longer says /tmp).
    return ServerArgs.expert_distribution_recorder_dir if hasattr(
        ServerArgs, "expert_distribution_recorder_dir") else None


@pytest.fixture(autouse=True)
def permissive_umask():
    old = os.umask(0o022)  # the usual umask: files 0644, directories 0755 unless asked
    yield
    os.umask(old)


def recorder(dump_dir: str | None) -> ExpertDistributionRecorder:
    """A per-token recorder with a (still empty) recorded window, ready to dump."""
    r = ExpertDistributionRecorder("per_token", ModelConfig.from_hf(TEST_MODEL_PATH),
                                   dump_dir=dump_dir)
    r.start()
    r.stop()
    return r


def test_default_dump_is_0600_in_a_0700_cache_dir(tmp_path, monkeypatch, recorder_dir_default):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = recorder(recorder_dir_default).dump()
    folder = os.path.dirname(path)
    print(f"default dump {path}: file {mode(path):o}, directory {mode(folder):o}")
    assert folder.startswith(str(tmp_path / "cache" / "sgl_jax"))
    assert mode(path) == 0o600 and mode(folder) == 0o700
    assert set(np.load(path).files)  # a real .npz


def test_an_existing_wider_default_dir_is_narrowed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "sgl_jax" / "expert_distribution"
    folder.mkdir(parents=True, mode=0o777)
    os.chmod(folder, 0o777)
    path = recorder(None).dump()
    assert os.path.dirname(path) == str(folder)
    assert mode(str(folder)) == 0o700 and mode(path) == 0o600


def test_configured_dir_still_used_and_files_0600(tmp_path):
    configured = tmp_path / "dumps" / "here"
    path = recorder(str(configured)).dump()
    assert os.path.dirname(path) == str(configured)
    assert mode(path) == 0o600


def test_a_symlinked_default_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "sgl_jax").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "sgl_jax" / "expert_distribution")
    with pytest.raises(PermissionError):
        recorder(None).dump()
