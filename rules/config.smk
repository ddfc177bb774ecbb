# The run's configuration, resolved as the CLI resolves it (draftline.core.config_layers):
# Snakemake has merged config/config.yaml, --configfile and --config; a built-in target's own
# settings (the toy's demo settings) go under them. Included before validation, which fills the
# schema's defaults.
import importlib.util
from pathlib import Path

# The repository's root: the folder above rules/ (not workflow.basedir, the folder of the main
# Snakefile, which is elsewhere when another workflow includes this one).
WORKFLOW_ROOT = Path(workflow.current_basedir.get_path_or_uri(secret_free=True)).parent


def _library_module(name):
    """A standard-library-only module of the library, loaded by its file path: importing the
    draftline package here would need its dependencies at parse time."""
    path = WORKFLOW_ROOT / "src" / "draftline" / "core" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_draftline_{name}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


_resolved = _library_module("config_layers").with_target_settings(dict(config))
config.clear()
config.update(_resolved)
