//! mflow's end-to-end cases on a real control plane, one test per case: `kwok::NAME` on kwok's
//! simulated node, `kubelet::NAME` on a real kubelet. Each is ignored unless asked for:
//!
//! ```sh
//! tests/e2e/kubernetes/run.sh                      # brings the cluster up, runs every case
//! tests/e2e/kubernetes/run.sh sigint_cancels       # one case
//! ```
//!
//! or, with a cluster already up in the right mode (`cluster.sh up kwok`):
//! `cargo nextest run -p mflow-e2e --run-ignored only -E 'test(/^kwok::/)'`.
//!
//! The bodies are in the modules by subject; the two lists below say which node each needs.

mod access;
mod connect;
mod follow;
mod notebook;
mod outside;
mod outside_reads;
mod pipeline;
mod pods;
mod signals;
mod train;

/// One `#[test]` per case, named as the case, ignored unless the suite's cluster is up.
macro_rules! cases {
    ($mode:ident: $($subject:ident::$name:ident),* $(,)?) => {$(
        #[test]
        #[ignore = "needs the end-to-end cluster: tests/e2e/kubernetes/run.sh"]
        fn $name() {
            mflow_e2e::run_case(mflow_e2e::Mode::$mode, stringify!($name), crate::$subject::$name);
        }
    )*};
}

/// Simulated pods: kwok ends each by the rules of `kwok-stages.yaml`.
mod kwok {
    cases!(Kwok:
        pipeline::dry_run_every_spec,
        pipeline::pipeline_runs_and_is_cached,
        pipeline::failing_stage,
        pipeline::flaky_stage_is_retried,
        pipeline::timeout_is_a_timeout,
        signals::sigkill_then_reattach,
        signals::sigterm_detaches_and_reattaches,
        signals::sigint_cancels,
        pipeline::foreign_object_is_left_alone,
        access::restricted_user,
        access::service_account_bound_by_shipped_rbac,
        access::no_trainer_controller,
        pipeline::train_on_two_nodes,
        connect::rejected_credentials,
        connect::missing_namespace,
        follow::pod_deleted_on_kwok_says_so,
        follow::many_nodes_kwok,
    );
}

/// Real pods: a kubelet with containerd and runc.
mod kubelet {
    cases!(Kubelet:
        pods::real_outputs_flow_downstream,
        pods::real_oom_kill,
        pods::missing_and_invalid_images,
        pods::cronjob_runs_mflow_in_a_pod,
        pods::cronjob_pod_sigterm_detaches,
        outside::outside_run_uploads_and_follows,
        outside::outside_detach_attach_cancel,
        outside::outside_driver_pod_deleted,
        outside_reads::outside_records_logs_report_download,
        outside_reads::outside_rights_of_a_person,
        outside_reads::outside_claim_without_storage_class,
        outside::outside_two_laptops_one_spec,
        outside_reads::outside_images_that_cannot_drive,
        follow::stage_pod_deleted_is_infra,
        follow::log_stream_survives_apiserver_restart,
        train::main_job_on_kubelet,
        train::main_job_pp2_on_kubelet,
        train::train_pod_deleted_resumes,
        train::train_on_two_nodes_kubelet,
        notebook::notebook_on_kubelet,
    );
}
