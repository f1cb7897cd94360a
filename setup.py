"""setuptools glue for one thing setup.cfg cannot say: ship hf_xla_fsdp_hook.pth at the top of site-packages.

The .pth is the opt-in start-up hook of docs/launch.md: at interpreter start it does nothing unless HF_XLA_FSDP is
set (one environment lookup), so processes that did not opt in are untouched. Regular installs and wheels get it
through build_py; editable installs (`pip install -e`, PEP 660) through editable_wheel.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "hf_xla_fsdp" / "hf_xla_fsdp_hook.pth"


class BuildPyWithHook(build_py):
    """build_py, plus the .pth at the root of the build (so of the wheel and of site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH.name)]


cmdclass = {"build_py": BuildPyWithHook}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class _WithHook:
        """An editable-install strategy that also writes the .pth into the editable wheel."""

        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self.inner(wheel, files, mapping)
            wheel.writestr(PTH.name, PTH.read_text())

    class EditableWheelWithHook(editable_wheel):
        """editable_wheel, plus the .pth beside setuptools' own __editable__ .pth."""

        def _select_strategy(self, *args, **kwargs):
            return _WithHook(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithHook
except ImportError:  # setuptools < 64: `pip install -e` runs develop, which build_py does not cover
    pass

setup(cmdclass=cmdclass)
