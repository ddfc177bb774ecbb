"""Serving plumbing: vLLM servers (a spec, managed processes, one shared server per run,
external endpoints; ``server``, with the Docker launcher in ``docker_launcher``), the clients
that talk to them (``endpoint_clients``, ``loadgen``: closed-loop windows and the server's
counters) and the pinned container images. It imports foundations only, never a stage."""
