# draftline: prompts -> synthetic responses -> dataset -> hidden states -> EAGLE-3 draft
# -> deployment benchmark -> verifiable bundle. Stages and artifacts: README.md.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


# A built-in target's settings under the config files, as `draftline plan` resolves them.
include: "rules/config.smk"


validate(config, "src/draftline/schemas/config.schema.yaml")


include: "rules/common.smk"


# --software-deployment-method apptainer runs every rule in the pipeline image and the rules that
# run vLLM in the serving image (serving_container()): digest-pinned docker:// URIs from config
# (containers/images.lock). Without them (null, the default) no rule uses a container.
container: config["containers"]["pipeline"]


include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/profile.smk"
include: "rules/generate.smk"
include: "rules/dataset.smk"
include: "rules/hidden.smk"
include: "rules/draft.smk"
include: "rules/bench.smk"
include: "rules/bundle.smk"


rule all:
    default_target: True
    input:
        final_outputs(),


onsuccess:
    stop_shared_servers()


onerror:
    stop_shared_servers()
