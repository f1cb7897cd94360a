"""Makes torch_xla unimportable in a process started with this folder first on ``PYTHONPATH`` (see
``helpers.torchrun``): the tests of engine fsdp2 prove that nothing on its path imports torch_xla, with the package
installed beside it as on the main test venv. The path finder reports it absent (``importlib.util.find_spec`` gives
None, ``import torch_xla`` raises ``ModuleNotFoundError``), exactly as where it is not installed."""

from importlib.machinery import PathFinder

_find_spec = PathFinder.find_spec.__func__


def _without_torch_xla(cls, fullname, path=None, target=None):  # noqa: ANN001, ANN202 - PathFinder's signature
    if fullname == "torch_xla" or fullname.startswith("torch_xla."):
        return None
    return _find_spec(cls, fullname, path, target)


PathFinder.find_spec = classmethod(_without_torch_xla)
