//! A run inside the nested host that lost the nested host itself (the emulation's
//! known problem: a stall, a silent reset, its kernel's crash; README) is started
//! again in a fresh one for the sections it had not measured yet, and the reports are
//! merged. A section's own failures (a figure's error) are results, not retried.

use crate::report::Report;
use crate::sections::{self, Section};

/// Nested hosts started for one benchmark run, the first included.
pub const ATTEMPTS: usize = 3;

/// What vmctl prints when it lost the nested host, not a guest in it.
const NESTED_HOST_LOST: [&str; 3] = [
    "the nested host stalled",
    "the nested host stopped before the VM finished",
    "the nested host's kernel crashed",
];

/// Whether a line of the nested run's output says the nested host itself was lost.
pub fn says_nested_host_lost(line: &str) -> bool {
    NESTED_HOST_LOST.iter().any(|sign| line.contains(sign))
}

/// The sections `report` holds figures for. Sections finish whole or not at all in
/// a saved report: the inner run saves it between sections.
pub fn measured(report: &Report) -> Vec<Section> {
    Section::ALL
        .into_iter()
        .filter(|section| match section {
            Section::Boot => !report.figures.is_empty(),
            Section::Churn => report.churn.is_some(),
            Section::Workspace => report.workspace.is_some(),
            Section::Fs => report.fs.is_some(),
            Section::Egress => report.egress.is_some(),
            Section::Agent => report.agent.is_some(),
        })
        .collect()
}

/// Of the `wanted` sections, those `report` does not hold (all of them without one).
pub fn missing(wanted: &[Section], report: Option<&Report>) -> Vec<Section> {
    let have = report.map(measured).unwrap_or_default();
    wanted
        .iter()
        .copied()
        .filter(|section| !have.contains(section))
        .collect()
}

/// Adds to `into` each section that `later` measured and `into` lacks; the rest of
/// `into` (its date, machine and configuration) stays, as the run's start.
pub fn merge(into: &mut Report, later: Report) {
    let have = measured(into);
    let adds = |section| !have.contains(&section);
    if adds(Section::Boot) && !later.figures.is_empty() {
        into.figures = later.figures;
        into.ratios = later.ratios;
    }
    if adds(Section::Churn) && later.churn.is_some() {
        into.churn = later.churn;
    }
    if adds(Section::Workspace) && later.workspace.is_some() {
        into.workspace = later.workspace;
    }
    if adds(Section::Fs) && later.fs.is_some() {
        into.fs = later.fs;
    }
    if adds(Section::Egress) && later.egress.is_some() {
        into.egress = later.egress;
    }
    if adds(Section::Agent) && later.agent.is_some() {
        into.agent = later.agent;
    }
    for section in later.sections {
        if !into.sections.contains(&section) {
            into.sections.push(section);
        }
    }
    into.sections.sort();
}

/// The report's note when sections are still missing after the last attempt.
pub fn incomplete_note(why: &str, missing: &[Section], attempts: usize) -> String {
    let tries = match attempts {
        1 => "1 nested host".to_string(),
        n => format!("{n} nested hosts"),
    };
    format!(
        "{why}; not measured: {} ({tries} tried)",
        sections::join(missing, ", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report_with(sections: &[Section]) -> Report {
        let mut report: Report =
            serde_json::from_value(crate::report::minimal_report_json("nested", false))
                .expect("a minimal report");
        report.sections = sections.to_vec();
        if sections.contains(&Section::Boot) {
            report.figures = serde_json::from_value(serde_json::json!([{
                "name": "boot_to_init_ms", "unit": "ms", "vmm": "vmctl",
                "median": 1.0, "p90": 1.0, "min": 1.0, "max": 1.0, "samples": [1.0]
            }]))
            .expect("a figure");
        }
        if sections.contains(&Section::Workspace) {
            report.workspace = Some(
                serde_json::from_value(serde_json::json!({
                    "note": "", "commands": [], "environment": [], "figures": [],
                    "ready_runs": [],
                    "config": {"ready_runs": 1, "exec_iterations": 1, "exec_warmup": 0,
                               "cli_iterations": 1, "kernel": "", "agent_initramfs": "",
                               "rootfs": "", "vm_cpus": 1, "vm_memory_mib": 1,
                               "vm_nested": false, "timeout_s": 1}
                }))
                .expect("a workspace report"),
            );
        }
        report
    }

    #[test]
    fn the_lost_nested_host_is_told_from_a_lost_guest() {
        assert!(says_nested_host_lost(
            "vmctl: error: the nested host stalled, so vmctl stopped it: its vCPU 0 ..."
        ));
        assert!(says_nested_host_lost(
            "error: the nested host stopped before the VM finished: it reset without a word"
        ));
        assert!(says_nested_host_lost(
            "the nested host's kernel crashed (not the guest's): Kernel panic"
        ));
        assert!(!says_nested_host_lost(
            "the guest kernel crashed: Kernel panic"
        ));
        assert!(!says_nested_host_lost(
            "vm-bench: [fs 1/3] guest fs_seq_read_mib_s: 12.0"
        ));
    }

    #[test]
    fn only_the_sections_a_report_lacks_are_measured_again() {
        let wanted = [Section::Boot, Section::Workspace, Section::Egress];
        assert_eq!(missing(&wanted, None), wanted);
        let partial = report_with(&[Section::Boot]);
        assert_eq!(measured(&partial), [Section::Boot]);
        assert_eq!(
            missing(&wanted, Some(&partial)),
            [Section::Workspace, Section::Egress]
        );
        let both = report_with(&[Section::Boot, Section::Workspace]);
        assert_eq!(missing(&[Section::Workspace], Some(&both)), []);
    }

    #[test]
    fn a_later_run_fills_in_the_sections_and_keeps_the_first_ones() {
        let mut first = report_with(&[Section::Boot]);
        first.date = "first".into();
        let mut later = report_with(&[Section::Boot, Section::Workspace]);
        later.date = "later".into();
        later.figures[0].median = 99.0;
        merge(&mut first, later);
        assert_eq!(first.date, "first");
        assert_eq!(first.figures[0].median, 1.0, "the first boot figures stay");
        assert!(first.workspace.is_some(), "the missing section is added");
        assert_eq!(first.sections, [Section::Boot, Section::Workspace]);
        assert_eq!(measured(&first), [Section::Boot, Section::Workspace]);
    }

    #[test]
    fn the_note_names_what_is_missing_and_the_tries() {
        let note = incomplete_note("stalled", &[Section::Fs, Section::Agent], 3);
        assert_eq!(
            note,
            "stalled; not measured: fs, agent (3 nested hosts tried)"
        );
        assert!(incomplete_note("x", &[Section::Boot], 1).ends_with("(1 nested host tried)"));
    }
}
