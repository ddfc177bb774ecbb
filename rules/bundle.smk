# The verifiable bundle: results/bundle/ + the deterministic results/bundle.tar, the model card
# for the report, and publishing (a local folder or any Snakemake storage target; the HF hub).
import shlex
import sys

# The build record (bundle.build.json, beside the tar and outside its hash) holds the command
# that ran the workflow. Jobs run in other processes, so the main process hands it down in the
# environment (not a param: a different command line alone must not make the bundle stale; a
# remote job without it records its own command line).
if workflow.is_main_process:
    os.environ["DRAFTLINE_COMMAND_LINE"] = shlex.join(sys.argv)


envvars:
    "DRAFTLINE_COMMAND_LINE",


rule bundle:
    input:
        checkpoint=res("draft/checkpoint/config.json"),
        weights=res("draft/checkpoint/model.safetensors"),
        vocab_map=res("vocab/vocab_map.safetensors"),
        coverage=res("vocab/coverage.json"),
        metrics=res("draft/metrics.jsonl"),
        eval=res("draft/eval.json"),
        prompts_summary=res("prompts/summary.json"),
        profile=profile_outputs(),
        bench=bench_outputs(),
        target=target_input(),
    output:
        manifest=res("bundle/manifest.json"),
        readme=res("bundle/README.md"),
        tar=res("bundle.tar"),
        record=res("bundle.build.json"),
        card=report(
            res("report/model_card.html"),
            caption="../report/model_card.rst",
            category="Bundle",
        ),
    log:
        "logs/bundle/bundle.log",
    conda:
        "../envs/draftline.yaml"
    params:
        config=bundle_config(),
        model=target_path,
        draft_ref=lambda wildcards, output: (
            config["bundle"]["hf_repo"] or os.path.dirname(output.manifest)
        ),
        code=code_hash("bundle.py"),
    script:
        "../scripts/bundle.py"


if config["bundle"]["publish_to"]:

    rule publish_bundle:
        input:
            tar=res("bundle.tar"),
            manifest=res("bundle/manifest.json"),
        output:
            tar=publish_target("bundle.tar"),
            manifest=publish_target("manifest.json"),
            sha256=publish_target("bundle.tar.sha256"),
        log:
            "logs/publish_bundle/publish.log",
        conda:
            "../envs/draftline.yaml"
        script:
            "../scripts/publish.py"


if config["bundle"]["hf_repo"]:

    rule push_bundle_to_hub:
        input:
            manifest=res("bundle/manifest.json"),
            readme=res("bundle/README.md"),
        output:
            res("bundle.hub.json"),
        log:
            "logs/push_bundle_to_hub/push.log",
        conda:
            "../envs/draftline.yaml"
        params:
            repo=config["bundle"]["hf_repo"],
            token_env="HF_TOKEN",
        script:
            "../scripts/publish.py"
