"""The name this node goes by in every label (`hostname`, DCGM's `Hostname`) and in the store's node record."""

from __future__ import annotations

import os
import socket

NODE_NAME_ENV = "GPUSCOPE_NODE_NAME"


def node_name() -> str:
    """$GPUSCOPE_NODE_NAME when set (a DaemonSet sets it from the pod's spec.nodeName: inside a pod the host name
    is the pod's, not the node's), else the host name.

    >>> os.environ[NODE_NAME_ENV] = "gpu-node-7"; node_name()
    'gpu-node-7'
    >>> del os.environ[NODE_NAME_ENV]; node_name() == socket.gethostname()
    True
    """
    name = os.environ.get(NODE_NAME_ENV, "").strip()
    return name or socket.gethostname()
