//! Which host CPUs the VM runs on: `VMCTL_VCPU_CPUS` in the VMM's environment, a list
//! such as `1-2` or `1,3`, as `taskset -c` takes it (unset or empty: any CPU, the
//! scheduler's choice).
//!
//! The VMM's main thread takes the set just before it starts the vCPU threads, which
//! inherit it, as do the device workers they start when the guest's drivers are ready:
//! from then on the whole VMM runs there (the main thread serves the block, rng and
//! console devices). vmctl's nested host sets it to keep the guest off its CPU 0
//! (docs/nested-host.md).

use std::io;

use vmm::process::VCPU_CPUS_ENV;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AffinityError {
    #[error(
        "{VCPU_CPUS_ENV}={0:?} is not a list of CPUs: give numbers and ranges such as \
         1-2 or 1,3, as taskset -c takes them, or leave it unset"
    )]
    NotAList(String),
    #[error("{VCPU_CPUS_ENV}={list:?} names CPU {cpu}, beyond the {max} this VMM can pin to")]
    TooHigh {
        list: String,
        cpu: usize,
        max: usize,
    },
    #[error("cannot run the vCPUs on CPUs {list:?} ({VCPU_CPUS_ENV}): {reason}")]
    Pin { list: String, reason: String },
}

/// The CPUs `VMCTL_VCPU_CPUS` names; `None` when it is unset or empty.
pub fn wanted() -> Result<Option<Vec<usize>>, AffinityError> {
    match std::env::var(VCPU_CPUS_ENV) {
        Ok(list) if !list.trim().is_empty() => parse(&list).map(Some),
        _ => Ok(None),
    }
}

/// Parses a CPU list: comma-separated numbers and `first-last` ranges.
pub fn parse(list: &str) -> Result<Vec<usize>, AffinityError> {
    let not_a_list = || AffinityError::NotAList(list.to_string());
    let number = |text: &str| text.trim().parse::<usize>().map_err(|_| not_a_list());
    let mut cpus = Vec::new();
    for item in list.split(',') {
        let (first, last) = match item.split_once('-') {
            Some((first, last)) => (number(first)?, number(last)?),
            None => (number(item)?, number(item)?),
        };
        if first > last {
            return Err(not_a_list());
        }
        let max = libc::CPU_SETSIZE as usize;
        if last >= max {
            return Err(AffinityError::TooHigh {
                list: list.to_string(),
                cpu: last,
                max,
            });
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Restricts the calling thread (and the threads it starts from now on) to `cpus`.
pub fn pin_this_thread(cpus: &[usize]) -> Result<(), AffinityError> {
    // SAFETY: an all-zero cpu_set_t is the empty set, a valid value of this plain
    // bitmask struct.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: `parse` keeps every CPU below CPU_SETSIZE, the set's capacity.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t that outlives the call, and its size is the
    // one passed; pid 0 names the calling thread.
    let result = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if result != 0 {
        let list: Vec<String> = cpus.iter().map(usize::to_string).collect();
        return Err(AffinityError::Pin {
            list: list.join(","),
            reason: io::Error::last_os_error().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_read_as_taskset_reads_them() {
        assert_eq!(parse("1-2"), Ok(vec![1, 2]));
        assert_eq!(parse("3,1, 2-3"), Ok(vec![1, 2, 3]));
        assert_eq!(parse("0"), Ok(vec![0]));
        for bad in ["", "x", "2-1", "1-", "-1", "1,,2", "1.5"] {
            assert_eq!(
                parse(bad),
                Err(AffinityError::NotAList(bad.into())),
                "{bad:?}"
            );
        }
        let error = parse("0-100000").unwrap_err().to_string();
        assert!(error.contains("CPU 100000"), "{error}");
    }

    #[test]
    fn a_thread_pinned_to_a_cpu_runs_there_and_its_children_inherit_it() {
        // A thread of its own, so the test harness's threads keep every CPU.
        std::thread::spawn(|| {
            // SAFETY: sched_getcpu takes no arguments.
            let cpu = unsafe { libc::sched_getcpu() };
            let cpu = usize::try_from(cpu).expect("sched_getcpu");
            pin_this_thread(&[cpu]).unwrap();
            let allowed = std::thread::spawn(allowed_cpus).join().unwrap();
            assert_eq!(allowed, vec![cpu], "a thread started after the pin");
        })
        .join()
        .unwrap();
        assert!(
            pin_this_thread(&[libc::CPU_SETSIZE as usize - 1]).is_err(),
            "a CPU this machine does not have is refused"
        );
    }

    fn allowed_cpus() -> Vec<usize> {
        // SAFETY: as in pin_this_thread, an all-zero cpu_set_t is valid.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is valid and writable for its size; pid 0 is this thread.
        let result = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
        assert_eq!(result, 0);
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: every index is below the set's capacity.
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
            .collect()
    }
}
