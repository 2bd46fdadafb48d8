import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One converted SmolLM2 cache shared by all test sessions on this machine (the conversion is what
# `make demo` does too); tests that exercise the conversion itself use their own SPARROW_HOME.
os.environ.setdefault("SPARROW_HOME", str(Path(__file__).resolve().parent.parent / ".sparrow-home"))


def _share_the_cores_between_workers() -> None:
    """Under `pytest -n W`, W worker processes each take cores / W threads: with every worker on every
    core, OpenMP's spin-waiting parallel regions (torch's and our CPU kernels') fight each other
    (`make test` went from about 8 to 14 minutes on 2 cores once the kernels ran in every engine test)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_between_workers()


def _take_ctrl_c_as_python_does() -> None:
    """Tests of Ctrl-C send SIGINT and expect Python's KeyboardInterrupt. A suite started in the background
    by a non-interactive shell (`make test &` in a script) inherits SIGINT ignored, and Python then leaves it
    ignored; take it as an interactive Python does (a child process then starts with it too)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_take_ctrl_c_as_python_does()



@pytest.fixture()
def no_work(monkeypatch):
    """A command that gets as far as loading a model stops there with an AssertionError: refusals must come
    first (`cli_checks.passed_the_checks` tells that a command got past them)."""
    import sparrow.stages.model.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", refuse)

@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, smollm2):
    """Two basic_arithmetic prompts (the embedded model's tokenizer) as a prompts artifact; test modules
    that need other prompts define their own `prompts_file`."""
    from sparrow.schemas import write_artifact
    from sparrow.stages.tasks import make_prompts

    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    write_artifact(make_prompts("basic_arithmetic", 2, 0, smollm2.tokenizer), path, "prompts")
    return path


@pytest.fixture(scope="session")
def smollm2():
    import torch

    from sparrow.stages.model.loading import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m")
