"""`gpuscope dashboard`: the web dashboard over a Prometheus server (the command lives in gpuscope.web)."""

from __future__ import annotations

import argparse

HELP = "the web dashboard over a Prometheus server: a whole fleet in one UI"
DESCRIPTION = ("Serves the agent's dashboard with the data of every agent a Prometheus server scrapes (GPU keys "
               "are hostname/gpu). Binds to 127.0.0.1 unless told otherwise; anything else requires the token.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..web.dashboard_cmd import add_arguments as add

    add(p)


def run(args: argparse.Namespace) -> int:
    from ..web.dashboard_cmd import run as serve

    return serve(args)
