"""pprof's profile.proto (github.com/google/pprof, proto/profile.proto), as a Python module generated from it.

profile.proto is pprof's file, unchanged but for a first line saying where it came from. The modules beside it
are generated and checked in, as the kubelet's in gpuscope/sources/_podresources are (and for the same reason:
no compiler at build time); tests/test_profile_pprof.py checks them against a fresh generation. Regenerate
after changing profile.proto or grpcio-tools, from the repository root:

    python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src src/gpuscope/trace/_pprof/profile.proto

The generated code needs protobuf at run time at least as new as the gencode it names (pyproject's `profile`
extra); only gpuscope.trace.profile imports it, and only to write pprof.
"""
