//! A directed graph of imports with the evidence of each edge, and its cycles: every strongly
//! connected component of more than one node (Tarjan's algorithm), each with the edges that
//! close it, so that a report names every import to remove, not only one circle.

use std::collections::{BTreeMap, BTreeSet};

/// Edges `from → to`, each with the places that make it (`src/a.rs:12 names super::b::X`).
#[derive(Clone, Debug, Default)]
pub struct Graph {
    edges: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

/// A cycle: its nodes, and the edges between them with their evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cycle {
    pub nodes: Vec<String>,
    pub edges: Vec<(String, String, Vec<String>)>,
}

impl Graph {
    /// Adds the edge `from → to` (none from a node to itself), made by `evidence`.
    pub fn add(&mut self, from: &str, to: &str, evidence: String) {
        if from == to {
            return;
        }
        self.edges
            .entry(from.to_string())
            .or_default()
            .entry(to.to_string())
            .or_default()
            .insert(evidence);
    }

    /// Whether the graph has the edge `from → to`.
    pub fn has(&self, from: &str, to: &str) -> bool {
        self.edges.get(from).is_some_and(|t| t.contains_key(to))
    }

    /// Every cycle (strongly connected component of two nodes or more), in node order.
    pub fn cycles(&self) -> Vec<Cycle> {
        let mut nodes: BTreeSet<&str> = self.edges.keys().map(String::as_str).collect();
        for targets in self.edges.values() {
            nodes.extend(targets.keys().map(String::as_str));
        }
        let mut tarjan = Tarjan {
            graph: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            next: 0,
            components: Vec::new(),
        };
        for node in nodes {
            if !tarjan.index.contains_key(node) {
                tarjan.connect(node);
            }
        }
        let mut cycles: Vec<Cycle> = tarjan
            .components
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|mut nodes| {
                nodes.sort();
                let members: BTreeSet<&String> = nodes.iter().collect();
                let mut edges = Vec::new();
                for from in &nodes {
                    for (to, evidence) in self.edges.get(from).into_iter().flatten() {
                        if members.contains(to) {
                            edges.push((
                                from.clone(),
                                to.clone(),
                                evidence.iter().cloned().collect(),
                            ));
                        }
                    }
                }
                Cycle { nodes, edges }
            })
            .collect();
        cycles.sort_by(|a, b| a.nodes.cmp(&b.nodes));
        cycles
    }
}

struct Tarjan<'a> {
    graph: &'a Graph,
    index: BTreeMap<&'a str, usize>,
    low: BTreeMap<&'a str, usize>,
    stack: Vec<&'a str>,
    on_stack: BTreeSet<&'a str>,
    next: usize,
    components: Vec<Vec<String>>,
}

impl<'a> Tarjan<'a> {
    // Recursive: the graphs are a few hundred files deep at most.
    fn connect(&mut self, node: &'a str) {
        self.index.insert(node, self.next);
        self.low.insert(node, self.next);
        self.next += 1;
        self.stack.push(node);
        self.on_stack.insert(node);
        let graph = self.graph;
        for to in graph.edges.get(node).into_iter().flat_map(|t| t.keys()) {
            let to = to.as_str();
            if !self.index.contains_key(to) {
                self.connect(to);
                let low = self.low[node].min(self.low[to]);
                self.low.insert(node, low);
            } else if self.on_stack.contains(to) {
                let low = self.low[node].min(self.index[to]);
                self.low.insert(node, low);
            }
        }
        if self.low[node] == self.index[node] {
            let mut component = Vec::new();
            while let Some(top) = self.stack.pop() {
                self.on_stack.remove(top);
                component.push(top.to_string());
                if top == node {
                    break;
                }
            }
            self.components.push(component);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cycle_is_found_with_its_edges() {
        let mut g = Graph::default();
        g.add("allocate", "matching", "a.rs:1".into());
        g.add("matching", "records", "m.rs:2".into());
        g.add("records", "allocate", "r.rs:3".into());
        g.add("records", "wire", "r.rs:4".into());
        g.add("x", "y", "x.rs:1".into());
        g.add("y", "x", "y.rs:1".into());
        g.add("z", "z", "z.rs:1".into());
        let cycles = g.cycles();
        assert_eq!(cycles.len(), 2, "{cycles:?}");
        assert_eq!(cycles[0].nodes, ["allocate", "matching", "records"]);
        assert_eq!(cycles[0].edges.len(), 3);
        assert_eq!(cycles[1].nodes, ["x", "y"]);
        let mut acyclic = Graph::default();
        acyclic.add("a", "b", String::new());
        acyclic.add("b", "c", String::new());
        assert!(acyclic.cycles().is_empty());
        assert!(acyclic.has("a", "b") && !acyclic.has("b", "a"));
    }
}
