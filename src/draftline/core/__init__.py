"""Foundations every stage stands on: the config and its checks, where each file lives
(``layout``), writing files whole (``atomic``), the target and the hub, machine records,
stage code hashes, prompt records, secret names. Nothing here imports a stage or the serving
plumbing; ``codehash``, ``config_check``, ``layout``, ``hub`` and ``secret_names`` use the
standard library only, so the workflow can load them by path with only Snakemake installed."""
