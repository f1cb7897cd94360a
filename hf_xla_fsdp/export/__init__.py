"""From rank files to what users load and share: PEFT adapter files and merged models (``peft``) and
``from_pretrained``-ready exports with a model card, pushed to the Hub if asked (``hub``).

``hf_xla_fsdp.export`` is this package and, called, :func:`hf_xla_fsdp.export.hub.export`
(``hf_xla_fsdp.export(source, output, repo_id=..., push=...)``): the package attribute of that name is the
subpackage once it is imported, so the subpackage itself is the function, and importing ``hf_xla_fsdp`` stays free
of torch.
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .hub import export

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
