//! Local resources: CPU slots and GPUs, handed out as disjoint CUDA_VISIBLE_DEVICES sets.

use crate::spec::Resources;

#[derive(Debug)]
pub struct Pool {
    cpus: f64,
    free_cpus: f64,
    free_gpus: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Grant {
    pub cpus: f64,
    pub gpus: Vec<String>,
}

impl Pool {
    pub fn new(cpus: usize, gpus: Vec<String>) -> Pool {
        Pool { cpus: cpus as f64, free_cpus: cpus as f64, free_gpus: gpus }
    }

    /// Whether `r` can ever be satisfied here.
    pub fn fits(&self, r: &Resources) -> Result<(), String> {
        let total_gpus = self.free_gpus.len();
        if (r.gpus as usize) > total_gpus && total_gpus == self.free_gpus.len() {
            return Err(format!("needs {} GPUs, this machine has {}", r.gpus, total_gpus));
        }
        Ok(())
    }

    /// Takes the resources if they are free now. A stage asking for more CPUs than exist gets
    /// the whole machine rather than waiting forever.
    pub fn take(&mut self, r: &Resources) -> Option<Grant> {
        let cpus = r.cpus.min(self.cpus).max(0.0);
        if cpus > self.free_cpus + 1e-9 || (r.gpus as usize) > self.free_gpus.len() {
            return None;
        }
        self.free_cpus -= cpus;
        let gpus = self.free_gpus.drain(..r.gpus as usize).collect();
        Some(Grant { cpus, gpus })
    }

    pub fn give(&mut self, g: Grant) {
        self.free_cpus += g.cpus;
        self.free_gpus.extend(g.gpus);
        self.free_gpus.sort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_are_disjoint_and_returned() {
        let mut p = Pool::new(4, vec!["0".into(), "1".into()]);
        let r = Resources { gpus: 1, cpus: 1.0, memory: None, ..Default::default() };
        let a = p.take(&r).unwrap();
        let b = p.take(&r).unwrap();
        assert_ne!(a.gpus, b.gpus);
        assert!(p.take(&r).is_none());
        p.give(a);
        assert!(p.take(&r).is_some());
    }

    #[test]
    fn oversized_cpu_requests_get_the_machine() {
        let mut p = Pool::new(2, vec![]);
        let g = p.take(&Resources { gpus: 0, cpus: 8.0, memory: None, ..Default::default() }).unwrap();
        assert_eq!(g.cpus, 2.0);
        assert!(p.take(&Resources { gpus: 0, cpus: 1.0, memory: None, ..Default::default() }).is_none());
    }
}
