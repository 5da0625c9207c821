//! Runs from outside the cluster, as from a laptop: the spec is in a directory that is not the
//! volume and `/mflow` is absent while mflow runs, so the project is uploaded and the engine runs
//! in the cluster as the driver Job, which mflow follows.

use std::path::Path;

use mflow_e2e::{secs, wait_until, Case, RunStatus};

/// The runs of the case's pipeline from outside the cluster, oldest first.
pub fn outside_runs(c: &Case) -> Vec<String> {
    Case::runs_in(&c.outside_workdir())
}

/// The running pod of a run's driver, if one runs.
pub fn driver_pod(c: &Case, run: &str) -> Option<String> {
    c.cluster().running_pods(&format!("mflow.dev/run={run}")).into_iter().next().and_then(|p| p.metadata.name)
}

fn lines_of(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|t| t.lines().count()).unwrap_or(0)
}

/// A pipeline of three stages from a checkout with a local input: the project is uploaded, the
/// driver runs it, the display and exit code are a local run's. A second run sends nothing and
/// runs nothing; a changed input is the only file sent; an upload above the bound is refused.
pub fn outside_run_uploads_and_follows(c: &Case) {
    let spec = c
        .outside_spec(
            r#"[stages.words]
kind = "command"
inputs = ["data/words.txt"]
run = ["sh", "-c", "wc -w < data/words.txt > $MFLOW_OUTPUT/n"]

[stages.times]
kind = "command"
needs = ["words"]
run = ["sh", "-c", "echo $(( $(cat $MFLOW_INPUT_WORDS/n) * 10 )) > $MFLOW_OUTPUT/n"]

[stages.model]
kind = "model"
source = "init:llama-tiny"
"#,
        )
        .write();
    let dir = Path::new(&spec).parent().expect("the spec's directory").to_path_buf();
    std::fs::create_dir_all(dir.join("data")).expect("a directory");
    std::fs::write(dir.join("data/words.txt"), "one two three four\n").expect("an input");
    c.mflow(["run", &spec])
        .outside()
        .run()
        .contains("upload: sent 2 of 2 files")
        .contains("✓ words succeeded")
        .contains("times | mflow: TrainJob")
        .contains("succeeded: 3 ran, 0 cached, 0 failed");
    assert!(!dir.join(".mflow").exists(), "a workdir was written outside the cluster");
    let run = outside_runs(c).pop().expect("a run on the volume");
    let rec = c.outside_record(&run);
    assert_eq!(rec.status, RunStatus::Succeeded);
    let times = rec.stages["times"].output.clone().unwrap_or_default();
    let n = std::fs::read_to_string(format!("{times}/n")).unwrap_or_default();
    assert_eq!(n.trim(), "40", "the downstream stage read the uploaded input");
    let model = rec.stages["model"].output.clone().unwrap_or_default();
    assert!(Path::new(&model).join("model.safetensors").is_file(), "the model stage wrote no model");

    c.mflow(["run", &spec])
        .outside()
        .run()
        .contains("upload: nothing to send, the project is on the volume (2 files)")
        .contains("succeeded: 0 ran, 3 cached, 0 failed");
    assert_eq!(c.trainjobs().len(), 3, "TrainJobs after the cached run");

    std::fs::write(dir.join("data/words.txt"), "one two three four\nfive\n").expect("an input");
    c.mflow(["run", &spec])
        .outside()
        .env("MFLOW_UPLOAD_MAX_BYTES", "10")
        .code(2)
        .run()
        .contains("more than the limit of 10 B")
        .contains("data/words.txt (24 B)");
    c.mflow(["run", &spec])
        .outside()
        .run()
        .contains("upload: sent 1 of 2 files")
        .contains("succeeded: 2 ran, 1 cached, 0 failed");
}

/// --detach returns the run id; attach follows it and Ctrl-C leaves it running; cancel stops
/// its stages, deletes their TrainJobs and records the run as cancelled.
pub fn outside_detach_attach_cancel(c: &Case) {
    let spec = c
        .outside_spec(
            r#"[stages.long]
kind = "command"
run = ["sh", "-c", "echo working; sleep 3600"]
"#,
        )
        .write();
    let detached = c.mflow(["run", "--detach", &spec]).outside().run();
    let run = detached.stdout.trim().to_string();
    assert!(!run.is_empty(), "--detach printed no run id");
    assert!(detached.stderr.contains(&format!("mflow attach {run}")), "--detach did not say how to attach");
    wait_until(secs(120), "the stage's pod to run", || c.running_pod(Some("long")).is_some());

    let attached = {
        let _away = c.outside();
        let attach = c.mflow(["attach", &run]).spawn();
        wait_until(secs(60), "attach to show the stage's output", || attach.printed("long | [rank 0] working"));
        attach.signal(libc::SIGINT);
        attach.wait()
    };
    assert_eq!(attached.code, 143, "attach after Ctrl-C");
    attached.contains(&format!("detached: run {run} goes on in the cluster"));
    assert!(driver_pod(c, &run).is_some(), "the driver stopped when attach was interrupted");
    assert_eq!(c.trainjobs().len(), 1, "TrainJobs");

    c.mflow(["cancel", &run]).outside().run().contains(&format!("run {run} cancelled"));
    assert_eq!(c.outside_record(&run).status, RunStatus::Cancelled);
    wait_until(secs(60), "the TrainJob to be deleted", || c.trainjobs().is_empty());
    c.mflow(["cancel", "no-such-run"]).outside().code(2).run().contains("no run no-such-run in namespace ml");
}

/// The driver's pod is deleted mid-run, as by a drain: the Job starts another, which reattaches
/// to the running TrainJob; nothing runs twice and the run ends as it would have.
pub fn outside_driver_pod_deleted(c: &Case) {
    let count = c.suite.volume.join(format!("{}-starts", c.pipeline()));
    let _ = std::fs::remove_file(&count);
    let spec = c
        .outside_spec(&format!(
            r#"[stages.slow]
kind = "command"
run = ["sh", "-c", "echo started >> {}; sleep 25; echo done > $MFLOW_OUTPUT/x"]

[stages.after]
kind = "command"
needs = ["slow"]
run = ["sh", "-c", "cat $MFLOW_INPUT_SLOW/x > $MFLOW_OUTPUT/x"]
"#,
            count.display()
        ))
        .write();
    let run = c.mflow(["run", "--detach", &spec]).outside().run().stdout.trim().to_string();
    wait_until(secs(120), "the stage's pod to run", || c.running_pod(Some("slow")).is_some());
    let pod = driver_pod(c, &run).expect("the driver's pod");
    c.cluster().delete_pod(&pod, None, true);
    c.mflow(["attach", &run])
        .outside()
        .timeout(secs(300))
        .run()
        .contains("reattaching to TrainJob")
        .contains(&format!("run {run}.2 succeeded: 2 ran, 0 cached, 0 failed"));
    assert_eq!(lines_of(&count), 1, "times the slow stage started");
    assert_eq!(c.outside_record(&run).status, RunStatus::Interrupted);
    assert_eq!(c.outside_record(&format!("{run}.2")).status, RunStatus::Succeeded);
    assert_eq!(c.trainjobs().len(), 2, "TrainJobs");
}

/// Two people start the same spec at once, each from a checkout of their own: both uploads
/// complete, both drivers run, and each stage runs once; the later run finds it cached.
pub fn outside_two_laptops_one_spec(c: &Case) {
    let count = c.suite.volume.join(format!("{}-starts", c.pipeline()));
    let _ = std::fs::remove_file(&count);
    let a = c
        .outside_spec(&format!(
            r#"[stages.slow]
kind = "command"
inputs = ["data.txt"]
run = ["sh", "-c", "echo started >> {}; sleep 15; cat data.txt > $MFLOW_OUTPUT/x"]
"#,
            count.display()
        ))
        .write();
    let a_dir = Path::new(&a).parent().expect("a directory");
    std::fs::write(a_dir.join("data.txt"), "same\n").expect("an input");
    let b_dir = c.suite.state.join("outside/second-laptop");
    std::fs::create_dir_all(&b_dir).expect("a directory");
    for file in ["spec.toml", "data.txt"] {
        std::fs::copy(a_dir.join(file), b_dir.join(file)).expect("a copy");
    }
    let b = b_dir.join("spec.toml").display().to_string();
    let (first, second) = {
        let _away = c.outside();
        let first = c.mflow(["run", &a]).spawn();
        let second = c.mflow(["run", &b]).spawn();
        (first.wait(), second.wait())
    };
    assert_eq!(first.code, 0, "exit of the first laptop");
    assert_eq!(second.code, 0, "exit of the second laptop");
    assert_eq!(lines_of(&count), 1, "times the stage started");
    assert!(
        first.text.contains("0 ran, 1 cached") || second.text.contains("0 ran, 1 cached"),
        "neither run found the stage cached"
    );
    // Both drivers ran the one uploaded tree, and neither upload was left inside it.
    let drivers = c.cluster().jobs(&format!("mflow.dev/component=driver,mflow.dev/pipeline={}", c.pipeline()));
    let mut projects: Vec<String> =
        drivers.iter().filter_map(|j| j.metadata.annotations.as_ref()?.get("mflow.dev/project").cloned()).collect();
    projects.sort();
    projects.dedup();
    assert_eq!(projects.len(), 1, "the uploaded trees of one project: {projects:?}");
    let tree = Path::new(&projects[0]);
    let name = tree.file_name().expect("a tree name").to_string_lossy().into_owned();
    let left: Vec<String> = std::fs::read_dir(tree)
        .unwrap_or_else(|e| panic!("reading {}: {e}", tree.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with(&format!("{name}.")))
        .collect();
    assert!(left.is_empty(), "an upload was left inside the tree: {left:?}");
}
