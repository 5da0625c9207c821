//! Where the suite's cluster, binaries and images are: the state directory `cluster.sh up`
//! wrote, and what `run.sh` exported.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The node of the cluster a case needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// kwok's simulated node: pods end by the rules of `kwok-stages.yaml`.
    Kwok,
    /// A real kubelet with containerd and runc.
    Kubelet,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Kwok => "kwok",
            Mode::Kubelet => "kubelet",
        })
    }
}

/// The running cluster and what the cases run against it.
#[derive(Debug, Clone)]
pub struct Suite {
    pub mode: Mode,
    /// The mflow binary under test (`MFLOW_BIN`, default the test build's `target/debug/mflow`).
    pub bin: PathBuf,
    /// The repository (its specs, docs and scripts).
    pub repo: PathBuf,
    /// `tests/e2e/kubernetes`: cluster.sh, image.sh, images.sh.
    pub scripts: PathBuf,
    /// The cluster's state directory (`MFLOW_E2E_STATE`, default `/tmp/mflow-e2e`).
    pub state: PathBuf,
    pub namespace: String,
    /// Where mflow and the pods see the artifact volume.
    pub volume: PathBuf,
    /// The image of command stages, and the runtimes (the hostnet ones on the kubelet).
    pub image: String,
    pub cpu_runtime: String,
    pub torch_runtime: String,
    /// The images of docker/Dockerfile that images.sh builds: `cpu-train` and `cpu`.
    pub train_image: String,
    pub cpu_image: String,
    /// The mflow home whose Python environment was provisioned before the suite, for the local
    /// runs the main job is compared with (`MFLOW_E2E_LOCAL_HOME`).
    pub local_home: PathBuf,
    /// `vars.iterations` of the main job when `MFLOW_E2E_MAIN_ITERATIONS` is set.
    pub main_iterations: Option<String>,
    /// The mflow wheel the notebook case installs (`MFLOW_E2E_WHEEL`; run.sh gives the newest of
    /// target/wheels/).
    pub wheel: Option<PathBuf>,
}

/// The stage image of the kubelet phase: busybox and the mflow under test (run.sh builds it).
pub const STAGE_IMAGE: &str = "mflow-e2e/mflow:dev";

fn env_or(name: &str, default: impl FnOnce() -> String) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(default)
}

impl Suite {
    /// The suite of the running cluster; panics, saying how to bring one up, when none runs in
    /// `mode`.
    pub fn load(mode: Mode) -> Suite {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../..");
        let repo = repo.canonicalize().unwrap_or(repo);
        let state = PathBuf::from(env_or("MFLOW_E2E_STATE", || "/tmp/mflow-e2e".into()));
        let running = std::fs::read_to_string(state.join("mode")).ok().filter(|_| state.join("env").exists());
        match running.as_deref().map(str::trim) {
            Some(m) if m == mode.to_string() => {}
            Some(m) => panic!(
                "the cluster in {} runs with {m}; this case needs {mode} \
                 (tests/e2e/kubernetes/run.sh CASE brings up the right one)",
                state.display()
            ),
            None => panic!(
                "no end-to-end cluster in {} (tests/e2e/kubernetes/run.sh brings one up and runs the cases)",
                state.display()
            ),
        }
        let bin = PathBuf::from(env_or("MFLOW_BIN", || repo.join("target/debug/mflow").display().to_string()));
        assert!(bin.is_file(), "no mflow binary at {} (build it, or set MFLOW_BIN)", bin.display());
        let home = env_or("HOME", || "/root".into());
        let cache = env_or("XDG_CACHE_HOME", || format!("{home}/.cache"));
        let (image, cpu_runtime, torch_runtime) = match mode {
            Mode::Kwok => ("busybox:1.36", "mflow-cpu", "mflow-torch"),
            Mode::Kubelet => (STAGE_IMAGE, "mflow-cpu-hostnet", "mflow-torch-hostnet"),
        };
        let suite = Suite {
            mode,
            bin,
            scripts: repo.join("tests/e2e/kubernetes"),
            repo,
            state,
            namespace: "ml".into(),
            volume: PathBuf::from("/mflow"),
            image: image.into(),
            cpu_runtime: cpu_runtime.into(),
            torch_runtime: torch_runtime.into(),
            train_image: env_or("MFLOW_E2E_TRAIN_IMAGE", || "localhost/mflow-cpu-train:e2e".into()),
            cpu_image: env_or("MFLOW_E2E_CPU_IMAGE", || "localhost/mflow-cpu:e2e".into()),
            local_home: PathBuf::from(env_or("MFLOW_E2E_LOCAL_HOME", || format!("{cache}/mflow"))),
            main_iterations: std::env::var("MFLOW_E2E_MAIN_ITERATIONS").ok().filter(|v| !v.is_empty()),
            wheel: std::env::var_os("MFLOW_E2E_WHEEL").filter(|v| !v.is_empty()).map(PathBuf::from),
        };
        suite.link_volume();
        suite
    }

    /// The kubeconfig of one of the cluster's identities: `admin`, `nobody`, `mflow-user`
    /// (mflow's shipped RBAC), `mflow-laptop` (what a case grants it).
    pub fn kubeconfig(&self, who: &str) -> PathBuf {
        self.state.join("kubeconfig").join(format!("{who}.kubeconfig"))
    }

    /// The hostPath directory behind the artifact claim.
    pub fn artifacts(&self) -> PathBuf {
        self.state.join("artifacts")
    }

    /// mflow sees the artifact volume where its pods do, at `/mflow`, as on a machine that
    /// mounts the same share: a link to the claim's directory. Anything else there is refused.
    pub fn link_volume(&self) {
        if let Ok(target) = std::fs::read_link(&self.volume) {
            if target == self.artifacts() {
                return;
            }
        }
        assert!(
            std::fs::symlink_metadata(&self.volume).is_err(),
            "{} exists and is not this suite's; move it away first",
            self.volume.display()
        );
        std::os::unix::fs::symlink(self.artifacts(), &self.volume)
            .unwrap_or_else(|e| panic!("linking {} to the volume: {e}", self.volume.display()));
    }

    /// Runs one of the suite's scripts (`cluster.sh stop trainer`, `image.sh NAME`, ...), which
    /// keep the cluster's machinery; panics when it fails, with what it printed.
    pub fn script(&self, script: &str, args: &[&str]) -> String {
        self.try_script(script, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Suite::script`] that says what failed instead of panicking (for the guards that put
    /// the cluster back while a case unwinds).
    pub fn try_script(&self, script: &str, args: &[&str]) -> Result<String, String> {
        let what = format!("{script} {}", args.join(" "));
        let out = Command::new("bash")
            .arg(self.scripts.join(script))
            .args(args)
            .env("MFLOW_E2E_STATE", &self.state)
            .output()
            .map_err(|e| format!("running {what}: {e}"))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        println!("$ {what}\n{text}");
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!("{what} failed: {}", out.status))
        }
    }
}
