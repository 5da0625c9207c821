//! Who may run mflow, and a cluster without Trainer's controller.

use mflow_e2e::Case;

use crate::pipeline::{message, DIAMOND};

/// A user with no rights is stopped by the preflight, which names what is missing and how to
/// grant it in this namespace; a user bound only by the shipped RBAC
/// (examples/kubernetes/rbac.yaml) runs the pipeline.
pub fn restricted_user(c: &Case) {
    let spec = c.spec(DIAMOND).write();
    let out = c.mflow(["run", &spec]).kubeconfig(c.suite.kubeconfig("nobody")).code(3).run();
    out.flat().contains("mflow kube rbac --namespace ml");
    out.contains("forbidden");
    assert_eq!(c.trainjobs().len(), 0, "TrainJobs of a user without rights");
    c.mflow(["run", &spec]).kubeconfig(c.suite.kubeconfig("mflow-user")).run();
    assert_eq!(c.trainjobs().len(), 4, "TrainJobs");
}

pub fn service_account_bound_by_shipped_rbac(c: &Case) {
    let sa = c.suite.state.join("sa.kubeconfig");
    c.suite.script("cluster.sh", &["sa-kubeconfig", &c.suite.namespace, "mflow", &sa.display().to_string()]);
    let spec = c.spec(DIAMOND).write();
    c.mflow(["run", &spec]).kubeconfig(&sa).run();
    assert_eq!(c.trainjobs().len(), 4, "TrainJobs");
}

/// Trainer's controller stopped and its webhooks taken away, as on a cluster where it was never
/// installed; both come back when the case ends, however it ends.
struct NoTrainer<'a> {
    case: &'a Case,
    webhooks: Option<mflow_e2e::Webhooks>,
}

impl<'a> NoTrainer<'a> {
    fn new(case: &'a Case) -> Self {
        let mut away = NoTrainer { case, webhooks: None };
        case.suite.script("cluster.sh", &["stop", "trainer"]);
        away.webhooks = Some(case.cluster().remove_webhooks("trainer"));
        away
    }
}

impl Drop for NoTrainer<'_> {
    fn drop(&mut self) {
        let started = self.case.suite.try_script("cluster.sh", &["start", "trainer"]);
        let restored = self.webhooks.take().map_or(Ok(()), |saved| self.case.cluster().restore_webhooks(saved));
        match started.and(restored) {
            Err(e) if std::thread::panicking() => println!("could not bring Trainer back: {e}"),
            Err(e) => panic!("could not bring Trainer back: {e}"),
            Ok(_) => {}
        }
    }
}

/// Without the Trainer controller (its webhooks out of the way, as with a controller that was
/// never installed), a TrainJob is accepted and nothing ever happens to it: mflow says where to
/// look and gives up after start_timeout as an infra failure.
pub fn no_trainer_controller(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.orphan]
kind = "command"
run = ["sh", "-c", "true"]
"#,
        )
        .kube(r#"start_timeout = "20s""#)
        .write();
    let out = {
        let _away = NoTrainer::new(c);
        c.mflow(["run", &spec]).code(3).run()
    };
    out.contains("has no pods after 10s").contains("kubeflow-system");
    let msg = message(&c.record(), "orphan");
    assert!(msg.contains("did not start within 20s"), "message: {msg}");
    assert_eq!(c.trainjobs().len(), 0, "the stuck TrainJob was deleted");
}
