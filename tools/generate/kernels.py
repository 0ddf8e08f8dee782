"""Jupyter kernels on Unix sockets, for the notebooks this repository runs unattended: the test
suite's (nbmake, and a test's own nbclient), `make notebooks` and `make pages` (papermill).

Over TCP, jupyter_client picks a kernel's five ports by binding port 0 and closing each socket, and
the kernel binds them a moment later; in between, another process may take one (an outgoing
connection's ephemeral port, a rendezvous) and the kernel dies with "ZMQError: Address already in
use" before the notebook's first cell: in the test suite, about one full run in three. Jupyter's
"ipc" transport puts each channel on a socket file instead, named for its kernel, in a folder of
this process's own: there is no such window. Pass `kernel_manager_class=UnixSocketKernelManager`
to nbclient's NotebookClient or to papermill.execute_notebook.
"""
import atexit
import functools
import os
import shutil
import tempfile
import uuid

from jupyter_client import AsyncKernelManager
from traitlets import default


@functools.cache
def sockets_folder():
    """This process's folder for its kernels' socket files (made once), removed when it exits."""
    folder = tempfile.mkdtemp(prefix="course-kernels-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class UnixSocketKernelManager(AsyncKernelManager):
    @default("transport")
    def _unix_sockets(self):
        return "ipc"

    @default("ip")
    def _socket_files(self):  # the kernel's sockets: this path with -1 ... -5 after it
        return os.path.join(sockets_folder(), uuid.uuid4().hex[:12])
