//! Elastic tab stops, laid out exactly as Go's `text/tabwriter` does with the settings the
//! upstream `kubectl-inspect-gpushare` used: minimum cell width 0, tab width 0, padding 2,
//! padding character space, no flags.
//!
//! The rules (our own port of the documented behaviour, not a copy):
//! - the text is cut into lines at `\n`, each line into cells at `\t`; a cell ended by a tab
//!   belongs to a column, the text after a line's last tab does not (it is printed as is);
//! - a *column block* is a run of consecutive lines that all have a tab-terminated cell in
//!   that column; its width is its widest cell (in characters) plus the padding;
//! - every tab-terminated cell is printed left-aligned and padded with spaces to its block's
//!   width, so a line ending in a tab ends in at least `padding` spaces;
//! - blocks of column *k+1* are found only inside a block of column *k* (a line with fewer
//!   cells ends the blocks of the columns to its right).
//!
//! It does not implement the other tabwriter options (right alignment, tab padding, the
//! escape character, `\v`/`\f` cells, HTML filtering): nothing here needs them.

/// Lays out `text` (lines ended by `\n`, cells by `\t`) with `padding` spaces between
/// columns, as Go's `tabwriter.NewWriter(w, 0, 0, padding, ' ', 0)` would print it.
pub(crate) fn align(text: &str, padding: usize) -> String {
    let lines: Vec<Vec<&str>> = text.split('\n').map(|l| l.split('\t').collect()).collect();
    let mut out = String::with_capacity(text.len() + text.len() / 2);
    let mut widths = Vec::new();
    format(&lines, padding, &mut widths, 0, lines.len(), &mut out);
    out
}

/// Number of tab-terminated cells of `line`.
fn columns(line: &[&str]) -> usize {
    line.len().saturating_sub(1)
}

fn width_of(cell: &str) -> usize {
    cell.chars().count()
}

/// Formats lines `line0..line1`, whose columns `0..widths.len()` are already sized.
fn format(
    lines: &[Vec<&str>],
    padding: usize,
    widths: &mut Vec<usize>,
    mut line0: usize,
    line1: usize,
    out: &mut String,
) {
    let column = widths.len();
    let mut this = line0;
    while this < line1 {
        if column >= columns(&lines[this]) {
            this += 1;
            continue;
        }
        // A block of this column starts here: print what comes before it.
        write_lines(lines, widths, line0, this, out);
        line0 = this;
        let mut width = 0;
        while this < line1 && column < columns(&lines[this]) {
            width = width.max(width_of(lines[this][column]) + padding);
            this += 1;
        }
        widths.push(width);
        format(lines, padding, widths, line0, this, out);
        widths.pop();
        line0 = this;
    }
    write_lines(lines, widths, line0, line1, out);
}

fn write_lines(
    lines: &[Vec<&str>],
    widths: &[usize],
    line0: usize,
    line1: usize,
    out: &mut String,
) {
    for (i, line) in lines.iter().enumerate().take(line1).skip(line0) {
        for (j, cell) in line.iter().enumerate() {
            out.push_str(cell);
            if let Some(width) = widths.get(j) {
                let pad = width.saturating_sub(width_of(cell));
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        // The last line is the text after the final newline (usually empty).
        if i + 1 < lines.len() {
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_padded_to_the_widest_cell_plus_two() {
        assert_eq!(
            align("a\tbb\tc\nddd\te\tf\n", 2),
            "a    bb  c\nddd  e   f\n"
        );
    }

    #[test]
    fn a_trailing_tab_leaves_the_padding() {
        assert_eq!(
            align("Allocated/Total:\n9/30 (30%)\t\n", 2),
            "Allocated/Total:\n9/30 (30%)  \n"
        );
    }

    #[test]
    fn a_line_without_tabs_ends_the_column_blocks() {
        // The long first cell does not widen the column after the tab-less line.
        assert_eq!(
            align("loooooong\tx\nplain line\na\tb\n", 2),
            "loooooong  x\nplain line\na  b\n"
        );
    }

    #[test]
    fn inner_columns_are_sized_per_block_of_the_outer_column() {
        // Line 2 has only one column, so column 1 forms two separate blocks.
        let text = "a\tb\tc\nx\ty\naaaa\tbbbbbb\tc\n";
        assert_eq!(align(text, 2), "a     b  c\nx     y\naaaa  bbbbbb  c\n");
    }

    #[test]
    fn width_counts_characters_not_bytes() {
        assert_eq!(align("é\tx\nab\ty\n", 2), "é   x\nab  y\n");
    }

    #[test]
    fn text_without_final_newline_is_kept() {
        assert_eq!(align("a\tb", 2), "a  b");
        assert_eq!(align("", 2), "");
    }
}
