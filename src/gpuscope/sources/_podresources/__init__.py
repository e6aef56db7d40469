"""The kubelet's PodResources API v1 (k8s.io/kubelet), as Python modules generated from its official proto.

api.proto is the kubelet's file, unchanged but for a header saying where it came from. The modules beside it
are generated and checked in, not generated at build time: a build step would make grpcio-tools (a compiler
and a second copy of protobuf, about 10 MB) a build dependency of every install, including the many that never
talk to a kubelet; the checked-in code is what reviewers read and what tests/test_podresources.py checks
against a fresh generation. Regenerate after changing api.proto or grpcio-tools, from the repository root:

    python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src \\
        src/gpuscope/sources/_podresources/api.proto

The generated code needs grpcio and protobuf at run time at least as new as the grpcio-tools that made it
(pyproject's `kubernetes` extra says which); only gpuscope.sources.podresources imports it, and only once the
agent is asked to read the kubelet.
"""
