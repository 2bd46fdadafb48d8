"""Paged-KV kernels (Triton) beside their torch references; the op API is `sparrow.kernels.ops`.

This folder is installed as `sparrow.kernels`. Python started in the repository root (`python -c`, a REPL,
a notebook) finds it as a top-level `kernels` as well, the name of the Hugging Face package that
transformers imports: imported under that name, it steps aside for the installed package, or says that
none is installed."""
import sys

if __name__ == "kernels":
    import importlib
    from pathlib import Path

    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _root]
    del sys.modules[__name__]
    try:
        sys.modules[__name__] = importlib.import_module("kernels")
    except ModuleNotFoundError as e:
        sys.path.append(str(_root))  # as it was, but last
        if e.name != "kernels":  # the installed package lacks something of its own
            raise
        raise ModuleNotFoundError(
            f"No module named 'kernels': {_root / 'kernels'} is Sparrow's sparrow.kernels, not the kernels "
            "package (start Python outside the repository root, or install kernels).",
            name="kernels") from None
