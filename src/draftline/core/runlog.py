"""Send a stage's stdout/stderr (progress bars included) to its Snakemake log file."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path


@contextlib.contextmanager
def logged(path: str | Path | None):
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", buffering=1) as fh, contextlib.redirect_stdout(fh), \
            contextlib.redirect_stderr(fh):
        try:
            yield
        except SystemExit:
            raise  # an exit on purpose (e.g. Ctrl-C during generation) said why already
        except BaseException:
            import traceback

            traceback.print_exc(file=fh)
            raise
        finally:
            sys.stdout.flush()
