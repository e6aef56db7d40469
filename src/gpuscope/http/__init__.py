"""The HTTP kit every gpuscope server stands on: the agent, the dashboard, the capture proxy and the guard proxy.

    net        --listen and --upstream parsing, loopback hosts (standard library only)
    limits     the exhaustion limits and their flags (standard library only)
    responses  JSON answers, the one error body, BadRequest
    auth       the token file, the dashboard cookie, the loopback-Host and bearer-token middleware, probes
    serve      start an aiohttp app on host:port with deadlines, a connection cap and signal handling
    tls        HTTPS: a certificate and key checked at start, re-read when they change (standard library only)

Nothing is imported here: `gpuscope.http.net` stays importable without aiohttp.
"""
