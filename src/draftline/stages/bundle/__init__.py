"""The reproducible artifact bundle: build, archive deterministically, verify, publish.

``results/bundle/`` is a Hugging Face style model folder whose root is the draft checkpoint
(vLLM and SGLang load it as it is), with the model card, the evidence behind it and
``manifest.json`` (every file with SHA-256 and size, plus provenance). ``results/bundle.tar``
holds the same files with sorted entries, fixed mtime, owner and modes: the same inputs give
the same bytes. Facts about one build (command line, host, time) go to ``bundle.build.json``
beside the tar, outside its bytes. Nothing time-dependent is bundled, and no secret: values
of environment variables named like keys, tokens or secrets are removed from every text file
and refused in binary ones.

Modules: ``inputs`` (what goes where), ``scrub`` (secrets), ``provenance`` (the artifact's
inputs, in the manifest), ``record`` (facts about one build, beside the tar), ``card`` (model card
facts), ``build``, ``archive`` (format, hashing, deterministic tar), ``verify``, ``rebuild`` (the
rebuild check), ``publish``.
This file only re-exports.
"""

from draftline.stages.bundle.archive import (
    BUNDLE_FORMAT,
    MANIFEST,
    README,
    TAR_ROOT,
    BundleError,
    VerifyError,
    write_deterministic_tar,
)
from draftline.stages.bundle.build import build_bundle, resolved_config
from draftline.stages.bundle.card import collect_card_facts
from draftline.stages.bundle.inputs import BundleInputs
from draftline.stages.bundle.provenance import collect_provenance
from draftline.stages.bundle.publish import publish_files, push_to_hub, write_push_record
from draftline.stages.bundle.rebuild import RebuildResult, main_rebuild, rebuild_check
from draftline.stages.bundle.record import build_record_path
from draftline.stages.bundle.scrub import scrub_args, scrub_config, secret_values
from draftline.stages.bundle.verify import main_verify, verify_bundle

__all__ = [
    "BUNDLE_FORMAT", "MANIFEST", "README", "TAR_ROOT", "BundleError", "BundleInputs",
    "RebuildResult", "VerifyError", "build_bundle", "build_record_path", "collect_card_facts",
    "collect_provenance", "main_rebuild", "main_verify", "publish_files", "push_to_hub",
    "rebuild_check", "resolved_config", "scrub_args", "scrub_config", "secret_values",
    "verify_bundle", "write_deterministic_tar", "write_push_record",
]
