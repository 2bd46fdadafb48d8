"""The embedded model's cache under $SPARROW_HOME: a full disk or quota while it is converted is one
sentence; the cache gets the umask's mode, so a home shared by a team serves all of it, and a cache another
user made private is named as such; temporaries of a killed conversion are removed by the next one.

The conversion is faked with a tiny decoder (the real one writes 538 MB): what is tested is where and how
the cache is written, not the GGUF's dequantisation."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import sparrow.stages.model.loading as loading
from sparrow.cli.app import app
from sparrow.stages.model.config import ModelConfig, ModelSpecError
from sparrow.stages.model.llama import Transformer

from cli_checks import error_line

runner = CliRunner()
TINY = ModelConfig(arch="llama", vocab_size=4096, hidden_size=64, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=32, tie_word_embeddings=True)  # 1 MiB of embeddings
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user's view needs root to switch users")


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """The embedded conversion, its model a tiny random decoder and no tokenizer."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loading, "embedded_gguf", lambda: gguf)
    monkeypatch.setattr(loading, "read_gguf", lambda src: (TINY, {}))
    monkeypatch.setattr(loading, "build_model", lambda cfg, state: Transformer(cfg))
    monkeypatch.setattr(loading, "gguf_tokenizer", lambda src: None)


@pytest.fixture
def shared_home(monkeypatch):
    """A SPARROW_HOME that every user can reach (pytest's tmp_path is private to its user)."""
    home = Path(tempfile.mkdtemp(prefix="sparrow-home-"))
    home.chmod(0o777)
    monkeypatch.setenv("SPARROW_HOME", str(home))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def with_umask(mask: int, fn: Callable[[], object]) -> object:
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def as_other_user(fn: Callable[[], str]) -> str:
    """`fn()` in a child process that another user runs (root: nobody; anyone else: themself, the cache
    having been made unreadable to them) -> what it returned or the message of what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            said = fn()
        except BaseException as e:
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


# ------------------------------------------------------------------ a full disk or quota


def test_a_write_past_the_file_size_limit_is_the_os_error_efbig(tmp_path):
    """RLIMIT_FSIZE is what a quota does to a write: the kernel answers EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        with pytest.raises(OSError) as raised:
            loading.save_weights({"w": torch.zeros(1024, 256)}, tmp_path / "model.safetensors")  # 1 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG
    assert raised.value.strerror == "File too large"
    assert raised.value.filename == str(tmp_path / "model.safetensors")


def test_a_quota_met_while_converting_is_the_homes_sentence(tmp_path, monkeypatch, fake_conversion):
    home = tmp_path / "home"
    monkeypatch.setenv("SPARROW_HOME", str(home))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        with pytest.raises(ModelSpecError) as raised:
            loading.embedded_checkpoint()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    said = str(raised.value)
    assert said.startswith(f"cannot build the smollm2-135m cache in {home / 'models' / 'smollm2-135m'} "
                           "(File too large); set SPARROW_HOME")
    assert [p.name for p in (home / "models").iterdir()] == [".smollm2-135m.lock"]  # no half cache left


def test_a_full_disk_while_converting_is_one_line_from_the_cli(tmp_path, monkeypatch, fake_conversion):
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # safetensors' own words for ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setenv("SPARROW_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "save_file", full)
    line = error_line(runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "2",
                                          "-o", str(tmp_path / "p.parquet")]))
    assert "cannot build the smollm2-135m cache" in line
    assert "(No space left on device); set SPARROW_HOME" in line
    assert not (tmp_path / "p.parquet").exists()


def test_a_safetensors_error_that_is_not_an_io_error_stays_what_it_is(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: header too large")

    monkeypatch.setattr(loading, "save_file", refuse)
    with pytest.raises(SafetensorError, match="header too large"):
        loading.save_weights({"w": torch.zeros(2)}, tmp_path / "model.safetensors")


# ------------------------------------------------------------------ a home shared by a team


@pytest.mark.parametrize(("mask", "folder_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_the_cache_gets_the_umasks_mode(tmp_path, monkeypatch, fake_conversion, mask, folder_mode, file_mode):
    monkeypatch.setenv("SPARROW_HOME", str(tmp_path / "home"))
    folder = with_umask(mask, loading.embedded_checkpoint)
    assert stat.S_IMODE(folder.stat().st_mode) == folder_mode
    files = sorted(folder.iterdir())
    assert {f.name for f in files} == {"config.json", "model.safetensors", "sparrow-cache.json"}
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == dict.fromkeys(
        ("config.json", "model.safetensors", "sparrow-cache.json"), file_mode)


@as_root
def test_a_shared_home_serves_another_user(shared_home, fake_conversion):
    folder = with_umask(0o022, loading.embedded_checkpoint)
    assert as_other_user(lambda: str(loading.embedded_checkpoint())) == str(folder)


def test_a_cache_another_user_made_private_is_named_as_unreadable(shared_home, fake_conversion):
    """The models folder is the team's; the cache in it was built under umask 077 (or by an older Sparrow,
    which made it 0700 whatever the umask)."""
    (shared_home / "models").mkdir(mode=0o755)
    folder = with_umask(0o077, loading.embedded_checkpoint)
    if os.geteuid() != 0:
        folder.chmod(0o000)  # what another user's private cache is to this one
    said = as_other_user(lambda: str(loading.embedded_checkpoint()))
    mode, owner = ("0700", "root") if os.geteuid() == 0 else ("0000", _me())
    assert said == (f"ModelSpecError: the smollm2-135m cache in {folder} exists but cannot be read by this "
                    f"user (mode {mode}, owner {owner}); ask its owner to run chmod -R a+rX {folder}, or set "
                    "SPARROW_HOME to a folder of your own")
    folder.chmod(0o700)


@as_root
def test_a_home_another_user_made_private_is_named_as_unreachable(shared_home, fake_conversion):
    folder = with_umask(0o077, loading.embedded_checkpoint)  # makes models/ too, 0700
    said = as_other_user(lambda: str(loading.embedded_checkpoint()))
    models = shared_home / "models"
    assert said == (f"ModelSpecError: the smollm2-135m cache in {folder} cannot be reached by this user "
                    f"({models} has mode 0700, owner root); ask its owner to run chmod -R a+rX {models}, or "
                    "set SPARROW_HOME to a folder of your own")


@as_root
def test_an_unreadable_file_in_the_cache_is_named(shared_home, fake_conversion):
    folder = with_umask(0o022, loading.embedded_checkpoint)
    (folder / "model.safetensors").chmod(0o600)  # as safetensors alone leaves it
    said = as_other_user(lambda: str(loading.embedded_checkpoint()))
    assert "cannot be read by this user (model.safetensors in it has mode 0600, owner root);" in said


# ------------------------------------------------------------------ what a killed conversion leaves


def test_a_killed_conversions_temporaries_are_removed_and_a_live_ones_kept(tmp_path, monkeypatch,
                                                                            fake_conversion):
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    monkeypatch.setenv("SPARROW_HOME", str(tmp_path / "home"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_tmp = models / f".smollm2-135m.0123456789ab-{gone.pid}.tmp"
        live_tmp = models / f".smollm2-135m.ba9876543210-{alive.pid}.tmp"
        older_tmp = models / ".smollm2-135m-k2x_9q0a"  # tempfile.mkdtemp's name in an older Sparrow
        for tmp in (dead_tmp, live_tmp, older_tmp):
            tmp.mkdir()
            (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
        other = models / f".qwen3-8b.0123456789ab-{gone.pid}.tmp"  # another cache's: not this one's to judge
        other.mkdir()
        loading.embedded_checkpoint()
        left = sorted(p.name for p in models.iterdir())
    finally:
        alive.kill()
        alive.wait()
    assert left == sorted([".smollm2-135m.lock", live_tmp.name, other.name, "smollm2-135m"])


def test_a_conversions_temporary_is_named_as_every_writer_names_its_own(tmp_path, monkeypatch,
                                                                         fake_conversion):
    """Hidden beside the cache, this process's pid in it: the name the next converter judges a dead one's
    temporary by (schemas/io.py's `leftovers`)."""
    monkeypatch.setenv("SPARROW_HOME", str(tmp_path / "home"))
    real, seen = loading.save_checkpoint, []

    def recorded(model, tokenizer, folder):
        seen.append((folder, loading.leftovers(tmp_path / "home" / "models" / "smollm2-135m")[0]))
        return real(model, tokenizer, folder)

    monkeypatch.setattr(loading, "save_checkpoint", recorded)
    loading.embedded_checkpoint()
    (folder, found), = seen
    assert re.fullmatch(rf"\.smollm2-135m\.[0-9a-f]{{12}}-{os.getpid()}\.tmp", folder.name)
    assert found == [folder]
