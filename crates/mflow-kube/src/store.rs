//! ConfigMaps mflow keeps in the cluster: workload code named by its digest, and the cache index.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::ByteString;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use serde::{Deserialize, Serialize};

use crate::error::api_status;
use crate::manifest::{
    workloads_configmap_name, ANN_KEY, ANN_PIPELINE, LABEL_COMPONENT, LABEL_KEY, LABEL_MANAGED_BY, LABEL_PIPELINE,
    MANAGED_BY, WORKLOADS_ZIP,
};
use crate::names::{dns_part, key_prefix, label_value};
use crate::{KubeBackend, KubeError};

/// ConfigMaps hold at most 1 MiB and binary data is stored base64-encoded (4/3 larger).
const MAX_WORKLOAD_BYTES: usize = 700_000;
const ANN_WORKLOAD_DIGEST: &str = "mflow.dev/workload-digest";
const ENTRY_KEY: &str = "entry.json";

/// What the cluster knows about one cached stage output. The engine decides the meaning of
/// the fields; the backend stores and returns them unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub stage: String,
    pub kind: String,
    /// Output directory, relative to the artifact volume root.
    pub output: String,
    /// Content digest of the committed output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// RFC 3339 time of the commit.
    pub created: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// The immutable ConfigMap that carries workload code with this digest (see
/// [`KubeBackend::ensure_workloads`]); pure, for rendering without a cluster.
pub fn workloads_configmap(digest: &str, files: &BTreeMap<String, String>) -> Result<ConfigMap, KubeError> {
    let archive = workloads_zip(files)?;
    Ok(ConfigMap {
        metadata: ObjectMeta {
            name: Some(workloads_configmap_name(digest)),
            labels: Some(BTreeMap::from([
                (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
                (LABEL_COMPONENT.to_string(), "workloads".to_string()),
            ])),
            annotations: Some(BTreeMap::from([(ANN_WORKLOAD_DIGEST.to_string(), digest.to_string())])),
            ..Default::default()
        },
        binary_data: Some(BTreeMap::from([(WORKLOADS_ZIP.to_string(), ByteString(archive))])),
        immutable: Some(true),
        ..Default::default()
    })
}

/// Name of the cache-index ConfigMap of one (pipeline, key).
pub(crate) fn cache_configmap_name(pipeline: &str, key: &str) -> String {
    let pipe = dns_part(pipeline);
    let pipe = &pipe[..pipe.len().min(40)];
    let hash = &blake3::hash(pipeline.as_bytes()).to_hex()[..6];
    format!("mflow-cache-{pipe}-{hash}-{}", key_prefix(key, 32))
}

fn owned_by_mflow(meta: &ObjectMeta) -> bool {
    meta.labels.as_ref().and_then(|l| l.get(LABEL_MANAGED_BY)).map(String::as_str) == Some(MANAGED_BY)
}

impl KubeBackend {
    fn configmaps(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), self.namespace())
    }

    /// Makes sure the immutable ConfigMap holding this workload code exists.
    ///
    /// `files` maps paths relative to the workloads root (`mflow_workloads/train.py`,
    /// `mflow_workloads/reference/model.py`) to their contents; they travel as one zip archive.
    pub async fn ensure_workloads(&self, digest: &str, files: &BTreeMap<String, String>) -> Result<(), KubeError> {
        self.put_workloads(digest, files, false).await
    }

    /// [`KubeBackend::ensure_workloads`] as a server-side dry run: the server checks the
    /// ConfigMap (or an existing one is checked for ownership) and stores nothing.
    pub async fn dry_run_workloads(&self, digest: &str, files: &BTreeMap<String, String>) -> Result<(), KubeError> {
        self.put_workloads(digest, files, true).await
    }

    async fn put_workloads(
        &self,
        digest: &str,
        files: &BTreeMap<String, String>,
        dry_run: bool,
    ) -> Result<(), KubeError> {
        let cm = workloads_configmap(digest, files)?;
        let name = workloads_configmap_name(digest);
        let api = self.configmaps();
        if let Some(existing) = api.get_opt(&name).await.map_err(|e| self.call_err(e, "get", "configmaps", &name))? {
            return self.check_workloads(&existing, &name, digest);
        }
        match api.create(&PostParams { dry_run, ..PostParams::default() }, &cm).await {
            Ok(_) => Ok(()),
            // Another mflow created it meanwhile; content-named, so it is the same.
            Err(e) if api_status(&e).is_some_and(|s| s.is_already_exists() || s.code == 409) => {
                let existing = api.get(&name).await.map_err(|e| self.call_err(e, "get", "configmaps", &name))?;
                self.check_workloads(&existing, &name, digest)
            }
            Err(e) => Err(self.call_err(e, "create", "configmaps", &name)),
        }
    }

    fn check_workloads(&self, cm: &ConfigMap, name: &str, digest: &str) -> Result<(), KubeError> {
        let theirs = cm.metadata.annotations.as_ref().and_then(|a| a.get(ANN_WORKLOAD_DIGEST));
        if owned_by_mflow(&cm.metadata) && theirs.map(String::as_str) == Some(digest) {
            Ok(())
        } else {
            Err(KubeError::ForeignObject {
                kind: "ConfigMap".into(),
                name: name.into(),
                reason: format!("its workload digest is {theirs:?}, expected {digest:?}"),
            })
        }
    }

    /// The cache-index entry of (pipeline, key), if the cluster has one.
    pub async fn cache_get(&self, pipeline: &str, key: &str) -> Result<Option<CacheEntry>, KubeError> {
        let name = cache_configmap_name(pipeline, key);
        let Some(cm) =
            self.configmaps().get_opt(&name).await.map_err(|e| self.call_err(e, "get", "configmaps", &name))?
        else {
            return Ok(None);
        };
        let ann = cm.metadata.annotations.clone().unwrap_or_default();
        if !owned_by_mflow(&cm.metadata)
            || ann.get(ANN_KEY).map(String::as_str) != Some(key)
            || ann.get(ANN_PIPELINE).map(String::as_str) != Some(pipeline)
        {
            // A name collision with something else is a miss, never a hit.
            tracing::warn!(configmap = %name, "cache index entry belongs to another pipeline or key; ignoring it");
            return Ok(None);
        }
        parse_entry(&cm, &name).map(Some)
    }

    /// Records (or replaces) the cache-index entry of (pipeline, key).
    pub async fn cache_put(&self, pipeline: &str, key: &str, entry: &CacheEntry) -> Result<(), KubeError> {
        let name = cache_configmap_name(pipeline, key);
        let body = serde_json::to_string_pretty(entry)
            .map_err(|e| KubeError::CacheCorrupt { name: name.clone(), message: e.to_string() })?;
        let mut cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([
                    (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
                    (LABEL_COMPONENT.to_string(), "cache".to_string()),
                    (LABEL_PIPELINE.to_string(), label_value(pipeline)),
                    (LABEL_KEY.to_string(), key_prefix(key, 32)),
                ])),
                annotations: Some(BTreeMap::from([
                    (ANN_PIPELINE.to_string(), pipeline.to_string()),
                    (ANN_KEY.to_string(), key.to_string()),
                ])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(ENTRY_KEY.to_string(), body)])),
            ..Default::default()
        };
        let api = self.configmaps();
        match api.create(&PostParams::default(), &cm).await {
            Ok(_) => return Ok(()),
            Err(e) if api_status(&e).is_some_and(|s| s.is_already_exists() || s.code == 409) => {}
            Err(e) => return Err(self.call_err(e, "create", "configmaps", &name)),
        }
        let existing = api.get(&name).await.map_err(|e| self.call_err(e, "get", "configmaps", &name))?;
        let ann = existing.metadata.annotations.clone().unwrap_or_default();
        if !owned_by_mflow(&existing.metadata) || ann.get(ANN_KEY).map(String::as_str) != Some(key) {
            return Err(KubeError::ForeignObject {
                kind: "ConfigMap".into(),
                name,
                reason: "it is not mflow's cache entry for this key".into(),
            });
        }
        cm.metadata.resource_version = existing.metadata.resource_version;
        api.replace(&name, &PostParams::default(), &cm)
            .await
            .map(|_| ())
            .map_err(|e| self.call_err(e, "update", "configmaps", &name))
    }

    /// Every cache-index entry of a pipeline, keyed by cache key (what `mflow plan` shows as
    /// cached in the cluster).
    pub async fn cache_list(&self, pipeline: &str) -> Result<BTreeMap<String, CacheEntry>, KubeError> {
        let selector = format!(
            "{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_COMPONENT}=cache,{LABEL_PIPELINE}={}",
            label_value(pipeline)
        );
        let list = self
            .configmaps()
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| self.call_err(e, "list", "configmaps", ""))?;
        let mut out = BTreeMap::new();
        for cm in list.items {
            let ann = cm.metadata.annotations.clone().unwrap_or_default();
            if ann.get(ANN_PIPELINE).map(String::as_str) != Some(pipeline) {
                continue;
            }
            let (Some(key), Some(name)) = (ann.get(ANN_KEY), cm.metadata.name.as_deref()) else { continue };
            out.insert(key.clone(), parse_entry(&cm, name)?);
        }
        Ok(out)
    }
}

fn parse_entry(cm: &ConfigMap, name: &str) -> Result<CacheEntry, KubeError> {
    let corrupt = |message: String| KubeError::CacheCorrupt { name: name.to_string(), message };
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get(ENTRY_KEY))
        .ok_or_else(|| corrupt(format!("key {ENTRY_KEY:?} is missing")))?;
    serde_json::from_str(text).map_err(|e| corrupt(format!("{ENTRY_KEY}: {e}")))
}

/// The workload tree as a zip archive, entries sorted and timestamps fixed, so equal trees give
/// equal bytes.
fn workloads_zip(files: &BTreeMap<String, String>) -> Result<Vec<u8>, KubeError> {
    use std::io::Write;
    use zip::write::SimpleFileOptions;

    let options = SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default());
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let mut total = 0usize;
    for (path, content) in files {
        let bad = |problem: String| KubeError::BadWorkload { path: path.clone(), problem };
        let safe = !path.is_empty()
            && !path.starts_with('/')
            && !path.contains('\\')
            && path.split('/').all(|part| !part.is_empty() && part != "." && part != "..");
        if !safe {
            return Err(bad("it must be a relative path without `.`, `..` or empty parts".into()));
        }
        total += content.len();
        if total > MAX_WORKLOAD_BYTES {
            return Err(bad(format!("the workload files exceed {MAX_WORKLOAD_BYTES} bytes, the ConfigMap budget")));
        }
        writer.start_file(path.as_str(), options).map_err(|e| bad(e.to_string()))?;
        writer.write_all(content.as_bytes()).map_err(|e| bad(e.to_string()))?;
    }
    let bytes = writer
        .finish()
        .map_err(|e| KubeError::BadWorkload { path: WORKLOADS_ZIP.into(), problem: e.to_string() })?
        .into_inner();
    if bytes.len() > MAX_WORKLOAD_BYTES {
        return Err(KubeError::BadWorkload {
            path: WORKLOADS_ZIP.into(),
            problem: format!(
                "the archive is {} bytes, over the {MAX_WORKLOAD_BYTES}-byte ConfigMap budget",
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}
