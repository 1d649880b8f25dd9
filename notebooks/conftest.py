"""nbmake's kernels on the kernel manager of the gate's own notebook runs
(dormouse.gate.pipeline.kernel_manager_class: sockets on private files, not
TCP ports that a fleet beside the notebook may take before the kernel binds
them). nbmake builds its nbclient NotebookClient itself and takes no kernel
manager, so its module's name for the client is pointed at a subclass whose
only change is that default."""

from __future__ import annotations

import nbmake.nb_run
from nbclient.client import NotebookClient
from traitlets import default

from dormouse.gate.pipeline import kernel_manager_class


class _NotebookClient(NotebookClient):
    @default("kernel_manager_class")
    def _kernel_manager_class_default(self):
        return kernel_manager_class()


nbmake.nb_run.NotebookClient = _NotebookClient
