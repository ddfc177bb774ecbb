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
        checkpoint=rules.export_draft.output.config,
        weights=rules.export_draft.output.weights,
        vocab_map=rules.vocab_map.output.vocab_map,
        coverage=rules.vocab_map.output.coverage,
        metrics=rules.train_draft.output.metrics,
        eval=rules.train_draft.output.eval,
        variant_configs=variant_files(LAYOUT.variant_checkpoint_config),
        variant_weights=variant_files(LAYOUT.variant_checkpoint_weights),
        variant_evals=variant_files(LAYOUT.variant_eval),
        variant_metrics=variant_files(LAYOUT.variant_metrics),
        prompts_summary=rules.prompt_shards.output.summary,
        generation=rules.generation_summary.output.json,
        profile=profile_outputs(),
        bench=bench_outputs(),
        target=target_input(),
    output:
        manifest=LAYOUT.bundle_manifest,
        readme=LAYOUT.bundle_readme,
        tar=LAYOUT.bundle_tar,
        record=LAYOUT.bundle_build_record,
        card=report(
            LAYOUT.model_card_html,
            caption="../report/model_card.rst",
            category="Bundle",
        ),
    log:
        LAYOUT.log("bundle", "bundle.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        config=bundle_config(),
        variants=VARIANTS,
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
            tar=rules.bundle.output.tar,
            manifest=rules.bundle.output.manifest,
        output:
            tar=publish_target("tar"),
            manifest=publish_target("manifest"),
            sha256=publish_target("sha256"),
        log:
            LAYOUT.log("publish_bundle", "publish.log"),
        conda:
            "../envs/draftline.yaml"
        script:
            "../scripts/publish.py"


if config["bundle"]["hf_repo"]:

    rule push_bundle_to_hub:
        input:
            manifest=rules.bundle.output.manifest,
            readme=rules.bundle.output.readme,
        output:
            LAYOUT.bundle_hub_record,
        log:
            LAYOUT.log("push_bundle_to_hub", "push.log"),
        conda:
            "../envs/draftline.yaml"
        params:
            repo=config["bundle"]["hf_repo"],
            token_env="HF_TOKEN",
        script:
            "../scripts/publish.py"
