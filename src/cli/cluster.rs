//! The commands that reach a run in a cluster (`attach`, `cancel`) and render what a cluster
//! needs (`kube rbac`).

use super::args::{ClusterArgs, KubeCommand};
use super::{runtime, Printer};
use crate::backend::kubernetes::outside;
use crate::exit::ExitCode;
use crate::reporter::console::Mode;
use crate::Error;

pub fn attach(run: &str, cluster: ClusterArgs, p: &Printer) -> Result<ExitCode, Error> {
    runtime()?.block_on(outside::attach(run, cluster.namespace, cluster.context, Mode::detect(p.json(), p.quiet())))
}

pub fn cancel(run: &str, cluster: ClusterArgs) -> Result<ExitCode, Error> {
    runtime()?.block_on(outside::cancel(run, cluster.namespace, cluster.context))
}

pub fn kube(c: KubeCommand, p: &Printer) -> Result<ExitCode, Error> {
    let KubeCommand::Rbac { namespace, mut service_accounts, users, groups, name } = c;
    if service_accounts.is_empty() && users.is_empty() && groups.is_empty() {
        service_accounts.push("mflow".into());
    }
    let subjects = mflow_kube::rbac::Subjects { service_accounts, users, groups };
    p.out(&mflow_kube::rbac::yaml(&name, &namespace, &subjects));
    Ok(ExitCode::Success)
}
