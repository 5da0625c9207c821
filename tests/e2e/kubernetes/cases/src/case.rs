//! One case: its name, its pipeline, its directory on the volume, its spec and its run records.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use mflow_contract::lock::Lockfile;
use mflow_contract::record::RunRecord;
use mflow_kube::LABEL_PIPELINE;

use crate::{Cluster, Mflow, Suite, TrainJob};

/// A case of the suite. Its pipeline is `e2e-<name with dashes>`; its spec and workdir live in
/// `/mflow/e2e/<name>` (or, for a spec from outside the cluster, in the state directory).
pub struct Case {
    pub name: String,
    pub suite: Suite,
    cluster: std::rc::Rc<Cluster>,
}

impl Case {
    pub fn new(suite: Suite, name: &str) -> Case {
        let cluster = Cluster::connect(&suite.kubeconfig("admin"), &suite.namespace);
        Case { name: name.into(), suite, cluster: std::rc::Rc::new(cluster) }
    }

    /// Another pipeline of the same case (its own name, spec and records), on the same cluster.
    pub fn part(&self, name: &str) -> Case {
        Case { name: name.into(), suite: self.suite.clone(), cluster: self.cluster.clone() }
    }

    /// The cluster, as its admin sees it.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub fn pipeline(&self) -> String {
        format!("e2e-{}", self.name.replace('_', "-"))
    }

    /// The case's directory on the volume.
    pub fn dir(&self) -> PathBuf {
        self.suite.volume.join("e2e").join(&self.name)
    }

    /// The workdir of a spec on the volume.
    pub fn workdir(&self) -> PathBuf {
        self.dir().join("wd")
    }

    /// The workdir of a run from outside the cluster: the pipeline's default one on the volume.
    pub fn outside_workdir(&self) -> PathBuf {
        self.suite.volume.join(self.pipeline())
    }

    /// `mflow ARGS`, to be run or spawned.
    pub fn mflow<I, S>(&self, args: I) -> Mflow
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        Mflow::new(&self.suite, args)
    }

    /// A spec on the volume, as mflow runs it where the volume is mounted: `[stages...]` given,
    /// `[pipeline]` and `[pipeline.kubernetes]` made for this cluster.
    pub fn spec(&self, stages: &str) -> SpecBuilder<'_> {
        SpecBuilder { case: self, stages: stages.into(), kube: Vec::new(), image: None, outside: false }
    }

    /// A spec in a directory that is not the volume (a laptop's checkout): the run goes through
    /// the upload and the driver Job. Its workdir is the pipeline's default one on the volume.
    pub fn outside_spec(&self, stages: &str) -> SpecBuilder<'_> {
        SpecBuilder { outside: true, ..self.spec(stages) }
    }

    /// Takes the volume away until the guard is dropped (see [`Outside`]).
    pub fn outside(&self) -> Outside {
        Outside::new(&self.suite)
    }

    /// The ids of the runs in a workdir, oldest first.
    pub fn runs_in(workdir: &Path) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(workdir.join("runs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("run.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        ids.sort();
        ids
    }

    /// The record of run `id` in a workdir, as mflow reads it (a record of an older format
    /// upgraded).
    pub fn record_in(workdir: &Path, id: &str) -> RunRecord {
        read_json::<RunRecord>(&workdir.join("runs").join(id).join("run.json")).upgraded()
    }

    /// The lockfile of run `id` in a workdir.
    pub fn lock_in(workdir: &Path, id: &str) -> Lockfile {
        read_json(&workdir.join("runs").join(id).join("mflow.lock"))
    }

    /// The newest run of the case's spec on the volume.
    pub fn newest_run(&self) -> String {
        let runs = Self::runs_in(&self.workdir());
        runs.last().cloned().unwrap_or_else(|| panic!("no run in {}", self.workdir().display()))
    }

    /// The record of the newest run of the case's spec on the volume.
    pub fn record(&self) -> RunRecord {
        Self::record_in(&self.workdir(), &self.newest_run())
    }

    /// The record of a run from outside the cluster.
    pub fn outside_record(&self, run: &str) -> RunRecord {
        Self::record_in(&self.outside_workdir(), run)
    }

    /// The log of attempt `n` of a stage in the newest run ("" when there is none).
    pub fn attempt_log(&self, stage: &str, n: u32) -> String {
        let path = self.workdir().join("runs").join(self.newest_run()).join(format!("stages/{stage}/attempt-{n}.log"));
        std::fs::read_to_string(path).unwrap_or_default()
    }

    /// The case pipeline's TrainJobs.
    pub fn trainjobs(&self) -> Vec<TrainJob> {
        self.cluster.trainjobs(&format!("{LABEL_PIPELINE}={}", self.pipeline()))
    }

    /// The label selector of one stage's objects in the case's pipeline.
    pub fn stage_selector(&self, stage: &str) -> String {
        format!("{LABEL_PIPELINE}={},{}={stage}", self.pipeline(), mflow_kube::LABEL_STAGE)
    }

    /// The running pod of a stage of the case's pipeline, if one runs.
    pub fn running_pod(&self, stage: Option<&str>) -> Option<String> {
        let selector = match stage {
            Some(stage) => self.stage_selector(stage),
            None => format!("{LABEL_PIPELINE}={}", self.pipeline()),
        };
        self.cluster.running_pods(&selector).into_iter().next().and_then(|p| p.metadata.name)
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{} is not what mflow writes: {e}", path.display()))
}

/// A case's spec: `c.spec(STAGES).kube("start_timeout = \"20s\"").write()`.
#[must_use = "a spec is written by `write`"]
pub struct SpecBuilder<'a> {
    case: &'a Case,
    stages: String,
    kube: Vec<String>,
    image: Option<String>,
    outside: bool,
}

impl SpecBuilder<'_> {
    /// A line of `[pipeline.kubernetes]` besides the image and the runtimes.
    pub fn kube(mut self, line: &str) -> Self {
        self.kube.push(line.into());
        self
    }

    /// The image of the stages (and the driver), instead of the suite's.
    pub fn image(mut self, image: &str) -> Self {
        self.image = Some(image.into());
        self
    }

    /// Writes the spec and returns its path.
    pub fn write(self) -> String {
        let c = self.case;
        let s = &c.suite;
        let image = self.image.as_deref().unwrap_or(&s.image);
        let (dir, workdir) = if self.outside {
            (s.state.join("outside").join(&c.name), String::new())
        } else {
            (c.dir(), format!("workdir = \"{}\"\n", c.workdir().display()))
        };
        let mut kube = self.kube.join("\n");
        if self.outside {
            // This cluster's pods reach the API server on the node's loopback only.
            kube.push_str(
                "\ndriver = { host_network = true, env = { KUBERNETES_SERVICE_HOST = \"127.0.0.1\", \
                 KUBERNETES_SERVICE_PORT = \"6443\" } }",
            );
        }
        let text = format!(
            "[pipeline]\nname = \"{}\"\nbackend = \"kubernetes\"\n{workdir}\n[pipeline.kubernetes]\nimage = \"{image}\"\n\
             cpu_runtime = \"{}\"\nruntime = \"{}\"\n{kube}\n\n{}",
            c.pipeline(),
            s.cpu_runtime,
            s.torch_runtime,
            self.stages
        );
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let path = dir.join("spec.toml");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path.display().to_string()
    }
}

/// The volume taken away while it lives: `/mflow` is removed, as on a laptop that does not
/// mount the share, and linked again when the guard is dropped, so that the case can check
/// what the run left on the volume.
pub struct Outside {
    suite: Suite,
}

impl Outside {
    pub fn new(suite: &Suite) -> Outside {
        let _ = std::fs::remove_file(&suite.volume);
        Outside { suite: suite.clone() }
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        self.suite.link_volume();
    }
}
