"""`gpuscope agent`: run the agent: sampler, on-disk history, /metrics and the query API."""

from __future__ import annotations

import argparse

from .._args import add_source_args, check_data_dir, check_sim, interval
from ..errors import UsageError

HELP = 'run the agent: sampler, on-disk history, /metrics and the query API'
DESCRIPTION = 'The main job on a GPU node: samples every GPU, keeps the history on disk (no database needed), serves Prometheus /metrics and a JSON query API. Binds to 127.0.0.1 unless told otherwise. SIGTERM or Ctrl-C stops it cleanly.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (see the README for every key)")
    p.add_argument("--port", type=int, help="TCP port (default 9471)")
    p.add_argument("--bind", help="address to listen on (default 127.0.0.1; anything else requires the token, "
                   "and HTTPS is advised: --tls-cert and --tls-key)")
    p.add_argument("--data-dir", help="where the history and the token live (default /var/lib/gpuscope as root, "
                   "else ~/.local/share/gpuscope)")
    p.add_argument("--interval", type=interval, help="sampling interval (default 100ms)")
    # metavar: argparse joins choices with commas, and one choice has a comma of its own.
    p.add_argument("--naming", choices=("canonical", "dcgm", "canonical,dcgm"), metavar="NAMING",
                   help="metric names on /metrics: canonical (gpuscope's), dcgm (dcgm-exporter's DCGM_FI_*), or "
                        "canonical,dcgm (both in one exposition)")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines as text or JSON")
    add_source_args(p, processes=True)
    p.add_argument("--churn", type=interval, metavar="SECONDS",
                   help="with --simulate: replace each simulated process by a new one (new pid and command line) "
                        "about every SECONDS (e.g. 60 or 5m), spread so that processes come and go continuously")
    p.add_argument("--simulate-workload", metavar="ID",
                   help="with --simulate: the simulated processes are ranks of torchrun run ID (TORCHELASTIC_RUN_ID "
                        "in their environment), so agents started with one ID (and GPUSCOPE_NODE_NAME=node-a, "
                        "node-b, ...) are one job across nodes: label workload=\"torchrun/ID\"")
    from ..http.tls import add_tls_args

    add_tls_args(p)


def run(args: argparse.Namespace) -> int:
    from ..agent import Agent, setup_logging
    from ..agent import config as agent_config

    check_sim(args)
    if args.churn is not None and args.simulate is None:
        raise UsageError("--churn only applies to a simulated node; add --simulate SCENARIO.")
    if args.simulate_workload is not None:
        if args.simulate is None:
            raise UsageError("--simulate-workload only applies to a simulated node; add --simulate SCENARIO.")
        from ..sim import check_workload

        check_workload(args.simulate_workload)
    if args.churn is not None and not 1 <= args.churn <= 7 * 86400:
        raise UsageError(f"--churn must be between 1s and 7d, not {args.churn:g} s.")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together: give both files, or neither.")
    cfg = agent_config.load(args.config)  # a ConfigError is a UsageError: exit 2
    if args.tls_cert:  # the pair of flags overrides the file's pair
        cfg.agent.tls_cert, cfg.agent.tls_key = args.tls_cert, args.tls_key
    for flag, section, key in (("port", "agent", "port"), ("bind", "agent", "bind"),
                               ("data_dir", "agent", "data_dir"), ("interval", "sampler", "interval"),
                               ("naming", "prometheus", "naming"), ("log_format", "agent", "log_format")):
        if getattr(args, flag) is not None:  # a flag overrides the file
            setattr(getattr(cfg, section), key, getattr(args, flag))
    agent_config.validate(cfg)
    # before anything starts: a file there made the agent say "not writable: File exists"
    check_data_dir(cfg.agent.data_dir,
                   "--data-dir" if args.data_dir is not None else f"{cfg.source}: [agent] data_dir")
    setup_logging(cfg.agent.log_format, "debug" if args.verbose else cfg.agent.log_level)
    tls = None
    if cfg.agent.tls_cert:  # checked before the GPUs are opened: TlsError, one sentence, exit 2
        from ..http.tls import ServerTls

        names = (("--tls-cert", "--tls-key") if args.tls_cert
                 else (f"{cfg.source}: [agent] tls_cert", f"{cfg.source}: [agent] tls_key"))
        tls = ServerTls(cfg.agent.tls_cert, cfg.agent.tls_key, cert_name=names[0], key_name=names[1])
    return Agent(cfg, simulate=args.simulate, gpus=args.gpus, processes=args.processes,
                 churn_s=args.churn, tls=tls, workload=args.simulate_workload).run()  # AgentError: exit 1
