//! Text renderings of a [`Report`]: the upstream summary table and details view (byte for
//! byte the layout of `kubectl-inspect-gpushare` v0.3.0+, with sorted rows), our `wide` view,
//! and JSON / YAML of the report model.
//!
//! Names and other data are only ever *arguments* of formatting, never part of a format
//! string (upstream passed built strings to `Fprintf`, so a `%` in a pod name corrupted the
//! output). Tabs and newlines inside data are replaced by spaces so they cannot break the
//! columns. Percentages are computed as upstream did (`int64(float64(used)/float64(total)*100)`,
//! truncating), so they match it to the digit.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::report::{NodeReport, PodShare, Report};

/// Column padding of the upstream tabwriter.
const PADDING: usize = 2;

/// Lays out `text` (lines ended by `\n`, cells by `\t`) in elastic tab stops as upstream's
/// `tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)` printed it: minimum cell width 0, padding 2
/// spaces, left-aligned, no flags. The `tabwriter` crate is a port of Go's `text/tabwriter`
/// with the same column blocks (a cell ended by a tab belongs to a column, the text after a
/// line's last tab does not, a line with fewer cells ends the blocks to its right) and, with
/// minimum width 0, the same widths (widest cell plus the padding).
///
/// One difference from Go, which cannot show here: the crate measures a cell in display
/// columns (Unicode width), Go in code points, so a double-width or zero-width character
/// would pad differently. Every cell here is a Kubernetes name (node, pod, namespace,
/// extended resource), an address, a number or the unit, all ASCII by the API server's
/// validation, where both measures are the byte count.
fn align(text: &str) -> String {
    let mut writer = tabwriter::TabWriter::new(Vec::with_capacity(text.len() + text.len() / 2))
        .minwidth(0)
        .padding(PADDING);
    // Writing into a `Vec` cannot fail, and the output is the input's UTF-8 with spaces
    // added; the fallbacks only keep this free of panics.
    if std::io::Write::write_all(&mut writer, text.as_bytes()).is_err() {
        return text.to_owned();
    }
    match writer.into_inner() {
        Ok(bytes) => String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
        Err(_) => text.to_owned(),
    }
}
/// Width of the bar in the `wide` view.
const BAR_WIDTH: u64 = 10;

/// A data value made safe for a tab-separated cell.
fn cell(text: &str) -> String {
    text.replace(['\t', '\n', '\r', '\x0b', '\x0c'], " ")
}

/// `used` as a percentage of `total`, truncated, computed in floating point as upstream did.
pub fn percent(used: u64, total: u64) -> i64 {
    if total == 0 {
        return 0;
    }
    (used as f64 / total as f64 * 100.0) as i64
}

fn notes(report: &Report, out: &mut String) {
    for note in &report.notes {
        let _ = writeln!(out, "note: {}", cell(note));
    }
}

/// The default view: one row per node, one column per GPU (upstream `displaySummary`).
pub fn table(report: &Report) -> String {
    let max_gpus = report.nodes.iter().map(|n| n.gpus.len()).max().unwrap_or(0);
    let has_pending = report.nodes.iter().any(|n| !n.pending.is_empty());
    let mut raw = String::from("NAME\tIPADDRESS\t");
    for i in 0..max_gpus {
        let _ = write!(raw, "GPU{i}(Allocated/Total)\t");
    }
    if has_pending {
        raw.push_str("PENDING(Allocated)\t");
    }
    let _ = writeln!(raw, "GPU Memory({})", cell(&report.unit));
    let mut dash_len = 0;
    for node in &report.nodes {
        let mut row = format!("{}\t{}\t", cell(&node.name), cell(&node.address));
        for i in 0..max_gpus {
            match node.gpus.get(i) {
                Some(g) => {
                    let _ = write!(row, "{}/{}\t", g.used, g.total);
                }
                None => row.push_str("0/0\t"),
            }
        }
        if has_pending {
            if !node.pending.is_empty() {
                let _ = write!(row, "{}", node.pending_memory());
            }
            row.push('\t');
        }
        let _ = writeln!(row, "{}/{}", node.used, node.total);
        if dash_len == 0 {
            // Upstream: the first row's raw length (tabs and newline included) + 20.
            dash_len = row.len() + 20;
        }
        raw.push_str(&row);
    }
    raw.push_str(&"-".repeat(dash_len));
    raw.push('\n');
    raw.push_str("Allocated/Total GPU Memory In Cluster:\n");
    let _ = writeln!(
        raw,
        "{}/{} ({}%)\t",
        report.used,
        report.total,
        percent(report.used, report.total)
    );
    let mut out = align(&raw);
    other_devices(report, &mut out);
    notes(report, &mut out);
    out
}

/// Below the GPU table: the devices other than GPUs each node offers (extended resources
/// beside the GPU's) and the pods holding them; nothing when no node offers any.
fn other_devices(report: &Report, out: &mut String) {
    if report.nodes.iter().all(|n| n.devices.is_empty()) {
        return;
    }
    let mut raw = String::from("\nNAME\tDEVICE\tAllocated/Total\tPODS\n");
    for node in &report.nodes {
        for d in &node.devices {
            let pods: Vec<String> = d
                .pods
                .iter()
                .map(|h| format!("{}({})", h.pod, h.count))
                .collect();
            let _ = writeln!(
                raw,
                "{}\t{}\t{}/{}\t{}",
                cell(&node.name),
                cell(&d.resource),
                d.used,
                d.total,
                cell(&pods.join(","))
            );
        }
    }
    out.push_str(&align(&raw));
}

/// One pod's row in the details view: its memory per GPU column and in pending.
struct PodRow {
    name: String,
    namespace: String,
    per_gpu: Vec<u64>,
    pending: u64,
}

type PodKey = (String, String, String);

fn row_of<'a>(rows: &'a mut BTreeMap<PodKey, PodRow>, p: &PodShare, gpus: usize) -> &'a mut PodRow {
    let key = (p.namespace.clone(), p.name.clone(), p.uid.clone());
    rows.entry(key).or_insert_with(|| PodRow {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        per_gpu: vec![0; gpus],
        pending: 0,
    })
}

/// The distinct pods of a node (a pod on several GPUs is one row), by namespace then name.
fn pod_rows(node: &NodeReport) -> Vec<PodRow> {
    let gpus = node.gpus.len();
    let mut rows = BTreeMap::new();
    for (i, gpu) in node.gpus.iter().enumerate() {
        for p in &gpu.pods {
            let r = row_of(&mut rows, p, gpus);
            r.per_gpu[i] = r.per_gpu[i].saturating_add(p.memory);
        }
    }
    for p in &node.pending {
        let r = row_of(&mut rows, p, gpus);
        r.pending = r.pending.saturating_add(p.memory);
    }
    rows.into_values().collect()
}

/// The `-d` view: per node, one row per pod (upstream `displayDetails`, rows sorted).
pub fn details(report: &Report) -> String {
    let mut raw = String::new();
    let mut dash_len = 0;
    for node in &report.nodes {
        raw.push('\n');
        let _ = writeln!(raw, "NAME:\t{}", cell(&node.name));
        let _ = writeln!(raw, "IPADDRESS:\t{}", cell(&node.address));
        raw.push('\n');
        raw.push_str("NAME\tNAMESPACE\t");
        for i in 0..node.gpus.len() {
            let _ = write!(raw, "GPU{i}(Allocated)\t");
        }
        let has_pending = !node.pending.is_empty();
        if has_pending {
            raw.push_str("Pending(Allocated)\t");
        }
        raw.push('\n');
        let mut rows = String::new();
        for pod in pod_rows(node) {
            let _ = write!(rows, "{}\t{}\t", cell(&pod.name), cell(&pod.namespace));
            for mem in &pod.per_gpu {
                let _ = write!(rows, "{mem}\t");
            }
            if has_pending {
                let _ = write!(rows, "{}\t", pod.pending);
            }
            rows.push('\n');
        }
        if dash_len == 0 {
            // Upstream: the first node's pod rows, raw, + 10; computed once.
            dash_len = rows.len() + 10;
        }
        raw.push_str(&rows);
        let _ = writeln!(
            raw,
            "Allocated :\t{} ({}%)\t",
            node.used,
            percent(node.used, node.total)
        );
        let _ = writeln!(raw, "Total :\t{} \t", node.total);
        raw.push_str(&"-".repeat(dash_len));
        raw.push('\n');
    }
    raw.push_str("\n\n");
    let _ = writeln!(
        raw,
        "Allocated/Total GPU Memory In Cluster:\t{}/{} ({}%)\t",
        report.used,
        report.total,
        percent(report.used, report.total)
    );
    let mut out = align(&raw);
    notes(report, &mut out);
    out
}

/// `[####------]` for `used` of `total` (full when over-committed).
pub(crate) fn bar(used: u64, total: u64) -> String {
    let filled = if total == 0 {
        if used > 0 { BAR_WIDTH } else { 0 }
    } else {
        let f = (used.min(total) as u128 * BAR_WIDTH as u128 / total as u128) as u64;
        // Any use shows at least one mark.
        if used > 0 { f.max(1) } else { f }
    };
    format!(
        "[{}{}]",
        "#".repeat(filled as usize),
        "-".repeat((BAR_WIDTH - filled) as usize)
    )
}

fn pod_list(pods: &[PodShare], with_state: bool) -> String {
    pod_list_in(pods, with_state, None)
}

/// The pods of a GPU; with `unit_bytes` (the `wide` view) a pod the node agent read back
/// shows `used/allocated` in the node's unit, and a limit not in force says so.
fn pod_list_in(pods: &[PodShare], with_state: bool, unit_bytes: Option<u64>) -> String {
    if pods.is_empty() {
        return "-".to_string();
    }
    pods.iter()
        .map(|p| {
            let mut s = format!("{}/{}=", cell(&p.namespace), cell(&p.name));
            match (&p.gpu_memory, unit_bytes) {
                (Some(m), Some(unit)) if unit > 0 => {
                    let _ = write!(s, "{:.1}/{}", m.used_bytes as f64 / unit as f64, p.memory);
                    if m.state != "enforced" {
                        let _ = write!(s, " (limit {})", cell(&m.state));
                    }
                }
                _ => {
                    let _ = write!(s, "{}", p.memory);
                }
            }
            if with_state {
                let _ = write!(s, " ({})", cell(&p.state));
            }
            s
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Bytes of one unit of a node's `unit` label (`GiB`, `MiB`, `256MiB`).
fn unit_bytes(unit: &str) -> Option<u64> {
    let unit: crate::core::MemoryUnit = unit.parse().ok()?;
    Some(unit.to_bytes(crate::core::GpuMem::new(1)))
}

/// Number of distinct pods holding memory on `node`.
fn pod_count(node: &NodeReport) -> usize {
    pod_rows(node).len()
}

/// The `wide` view: per node a line with its total and the largest request that still fits
/// on one healthy GPU, then per GPU a bar, health and the pods on it, then the pending pods.
pub fn wide(report: &Report) -> String {
    let mut raw = format!(
        "NAME\tIPADDRESS\tGPU\tALLOCATED({})\tSTATUS\tPODS\n",
        cell(&report.unit)
    );
    for node in &report.nodes {
        let unit = cell(&node.unit);
        let _ = writeln!(
            raw,
            "{}\t{}\tall\t{}/{} ({}%)\tfits: {} {unit}\t{} pod(s)",
            cell(&node.name),
            cell(&node.address),
            node.used,
            node.total,
            percent(node.used, node.total),
            node.largest_fit,
            pod_count(node),
        );
        for gpu in &node.gpus {
            let _ = writeln!(
                raw,
                "\t\t{}\t{} {}/{}\t{}\t{}",
                gpu.index,
                bar(gpu.used, gpu.total),
                gpu.used,
                gpu.total,
                if gpu.healthy { "healthy" } else { "UNHEALTHY" },
                pod_list_in(&gpu.pods, false, unit_bytes(&node.unit)),
            );
        }
        if !node.pending.is_empty() {
            let _ = writeln!(
                raw,
                "\t\tpending\t{}\t\t{}",
                node.pending_memory(),
                pod_list(&node.pending, true),
            );
        }
    }
    let _ = writeln!(
        raw,
        "\nAllocated/Total GPU Memory In Cluster: {}/{} ({}%)",
        report.used,
        report.total,
        percent(report.used, report.total)
    );
    let mut out = align(&raw);
    notes(report, &mut out);
    out
}

/// The report as pretty JSON (schema: the `Report` type, camelCase keys).
pub fn json(report: &Report) -> String {
    match serde_json::to_string_pretty(report) {
        Ok(mut s) => {
            s.push('\n');
            s
        }
        // Plain data with string keys: serialization cannot fail.
        Err(e) => format!("{{\"error\":{:?}}}\n", e.to_string()),
    }
}

/// The report as YAML (same schema as JSON).
pub fn yaml(report: &Report) -> String {
    yaml_serde::to_string(report).unwrap_or_else(|e| format!("error: {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // The layout rules of upstream's tabwriter, as `align` must keep them.
    #[test]
    fn columns_are_padded_to_the_widest_cell_plus_two() {
        assert_eq!(align("a\tbb\tc\nddd\te\tf\n"), "a    bb  c\nddd  e   f\n");
    }

    #[test]
    fn a_trailing_tab_leaves_the_padding() {
        assert_eq!(
            align("Allocated/Total:\n9/30 (30%)\t\n"),
            "Allocated/Total:\n9/30 (30%)  \n"
        );
    }

    #[test]
    fn a_line_without_tabs_ends_the_column_blocks() {
        // The long first cell does not widen the column after the tab-less line.
        assert_eq!(
            align("loooooong\tx\nplain line\na\tb\n"),
            "loooooong  x\nplain line\na  b\n"
        );
    }

    #[test]
    fn inner_columns_are_sized_per_block_of_the_outer_column() {
        // Line 2 has only one column, so column 1 forms two separate blocks.
        let text = "a\tb\tc\nx\ty\naaaa\tbbbbbb\tc\n";
        assert_eq!(align(text), "a     b  c\nx     y\naaaa  bbbbbb  c\n");
    }

    #[test]
    fn width_counts_characters_not_bytes() {
        assert_eq!(align("é\tx\nab\ty\n"), "é   x\nab  y\n");
    }

    #[test]
    fn text_without_final_newline_is_kept_as_upstream_printed_it() {
        assert_eq!(align("a\tb"), "a  b");
        assert_eq!(align(""), "");
    }

    #[test]
    fn percentages_truncate_like_go() {
        assert_eq!(percent(9, 30), 30);
        // 29/100*100 is 28.999999999999996 in floating point: Go printed 28.
        assert_eq!(percent(29, 100), 28);
        assert_eq!(percent(1, 0), 0);
        assert_eq!(percent(2, 3), 66);
    }

    #[test]
    fn an_empty_cluster_prints_the_upstream_frame() {
        let report = Report::from_nodes("api", Vec::new());
        assert_eq!(
            table(&report),
            "NAME  IPADDRESS  GPU Memory(GiB)\n\nAllocated/Total GPU Memory In Cluster:\n0/0 (0%)  \n"
        );
        assert_eq!(
            details(&report),
            "\n\nAllocated/Total GPU Memory In Cluster:  0/0 (0%)  \n"
        );
    }

    #[test]
    fn bars_show_any_use_and_cap_at_full() {
        assert_eq!(bar(6, 15), "[####------]");
        assert_eq!(bar(0, 15), "[----------]");
        assert_eq!(bar(1, 1000), "[#---------]");
        assert_eq!(bar(20, 15), "[##########]");
        assert_eq!(bar(0, 0), "[----------]");
    }
}
