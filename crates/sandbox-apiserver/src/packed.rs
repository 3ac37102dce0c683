//! Objects' JSON as the store keeps it: LZ4-compressed against a dictionary of earlier objects of
//! the same resource.
//!
//! The JSON is what the store holds most of: every current object and every version the watch
//! history still keeps. In a rehearsal of a 1,000-node cluster (20,000 pods evicted, as many
//! replacements created) it was 89 MB of a 237 MB heap. Objects of one resource share most of
//! their text (keys, images, label keys, owner kinds, condition types), so compressed against a
//! few earlier ones a 1.7 KB pod keeps about 300 bytes (LZ4 alone, without a dictionary, gets
//! under 2×). LZ4 because every watch event and list item is decompressed once per reader: it
//! decompresses at memory speed, where a rehearsal's whole run is a few hundred MB of JSON.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::store::GroupResource;

/// Text of earlier objects an object is compressed against. LZ4 looks back at most 64 KiB.
const DICTIONARY_MAX: usize = 48 * 1024;

/// Smaller than this, an object is kept as it is: a dictionary saves little on it.
const PACK_MIN: usize = 64;

/// The text an object was compressed against; shared by every object compressed with it, and
/// freed with the last of them.
#[derive(Debug, Clone)]
struct Dictionary(Arc<[u8]>);

#[derive(Debug)]
struct Packed {
    /// Length of the JSON.
    raw_len: u32,
    /// `None`: `data` is the JSON itself.
    dictionary: Option<Dictionary>,
    data: Box<[u8]>,
}

/// One version of an object as JSON, compressed. Cheap to clone: the store, the watch history
/// and the change stream share it.
#[derive(Debug, Clone)]
pub struct Json(Arc<Packed>);

impl Json {
    /// Keeps `raw` uncompressed (for objects that are not the store's, e.g. in tests).
    pub fn plain(raw: Vec<u8>) -> Json {
        Json::stored(raw, None)
    }

    fn stored(raw: Vec<u8>, dictionary: Option<Dictionary>) -> Json {
        let raw_len = u32::try_from(raw.len()).unwrap_or(u32::MAX);
        Json(Arc::new(Packed { raw_len, dictionary, data: raw.into_boxed_slice() }))
    }

    fn pack(raw: Vec<u8>, dictionary: &Dictionary) -> Json {
        // a JSON object of 4 GiB is far beyond what any write carries (the HTTP layer refuses
        // bodies long before); it is kept as it is rather than miscounted
        let Ok(raw_len) = u32::try_from(raw.len()) else { return Json::stored(raw, None) };
        if raw.len() < PACK_MIN {
            return Json::stored(raw, None);
        }
        let data = lz4_flex::block::compress_with_dict(&raw, &dictionary.0);
        if data.len() >= raw.len() {
            return Json::stored(raw, None);
        }
        Json(Arc::new(Packed { raw_len, dictionary: Some(dictionary.clone()), data: data.into_boxed_slice() }))
    }

    /// Length of the JSON.
    pub fn len(&self) -> usize {
        self.0.raw_len as usize
    }

    /// Whether the JSON is empty (never, for a stored object).
    pub fn is_empty(&self) -> bool {
        self.0.raw_len == 0
    }

    /// Appends the JSON to `out`.
    pub fn write_into(&self, out: &mut Vec<u8>) {
        let p = &*self.0;
        let Some(dict) = &p.dictionary else {
            out.extend_from_slice(&p.data);
            return;
        };
        let start = out.len();
        out.resize(start + p.raw_len as usize, 0);
        // The data is what `pack` compressed against this very dictionary, so it decompresses;
        // were it not, the object reads as nothing (`null` once parsed) rather than as garbage.
        match lz4_flex::block::decompress_into_with_dict(&p.data, &mut out[start..], &dict.0) {
            Ok(n) => out.truncate(start + n),
            Err(_) => out.truncate(start),
        }
    }

    /// The JSON.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        self.write_into(&mut out);
        out
    }

    /// The object, parsed (`null` if the JSON is not an object the store wrote).
    pub fn value(&self) -> Value {
        serde_json::from_slice(&self.to_vec()).unwrap_or(Value::Null)
    }

    /// Bytes held for this version alone (its dictionary is shared).
    #[cfg(test)]
    pub(crate) fn packed_len(&self) -> usize {
        self.0.data.len()
    }
}

/// Per resource, the dictionary its objects are compressed against: the text of objects
/// written at the 1st, 2nd, 4th, 8th… write of that resource, newest last, at most
/// [`DICTIONARY_MAX`]. Sampling at doubling intervals spreads the samples over the whole load
/// (a copy restores namespace by namespace, so the first pods are all of one or two
/// workloads) and over the run (the replacement pods a drain creates are shaped otherwise than
/// the running ones), while the dictionary changes only a few dozen times in all.
#[derive(Debug, Default)]
pub(crate) struct Packer {
    resources: HashMap<GroupResource, Sampler>,
}

#[derive(Debug, Default)]
struct Sampler {
    writes: u64,
    text: Vec<u8>,
    current: Option<Dictionary>,
}

impl Packer {
    /// `obj` of `gr` as JSON, compressed.
    pub(crate) fn pack(&mut self, gr: &GroupResource, obj: &Value) -> Json {
        // Serializing a Value cannot fail: its map keys are strings.
        let raw = serde_json::to_vec(obj).unwrap_or_default();
        let sampler = match self.resources.get_mut(gr) {
            Some(s) => s,
            None => self.resources.entry(gr.clone()).or_default(),
        };
        sampler.writes += 1;
        let sampled = sampler.writes.is_power_of_two();
        if sampled {
            sampler.text.extend_from_slice(&raw);
            if sampler.text.len() > DICTIONARY_MAX {
                let cut = sampler.text.len() - DICTIONARY_MAX;
                sampler.text.drain(..cut);
            }
        }
        let packed = match &sampler.current {
            Some(d) => Json::pack(raw, d),
            None => Json::stored(raw, None),
        };
        if sampled {
            sampler.current = Some(Dictionary(sampler.text.as_slice().into()));
        }
        packed
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(i: usize) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("web-{i}"), "namespace": format!("apps-{}", i % 7),
                "uid": format!("4f6c{i:04}-20fb-45cc-8c99-f2fd3af4e107"), "resourceVersion": (1000 + i).to_string(),
                "labels": {"app": format!("web-{}", i % 13), "pod-template-hash": "5d4f8b7c9"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("web-{}-5d4f8b7c9", i % 13),
                    "uid": "1f3e894d-20fb-45cc-8c99-f2fd3af4e107", "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"containers": [{"name": "web", "image": "public.ecr.aws/eks-distro/kubernetes/pause:3.2",
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}],
                "nodeName": format!("ip-10-12-{}-{}.us-west-2.compute.internal", i % 250, i % 97),
                "terminationGracePeriodSeconds": 30},
            "status": {"phase": "Running", "podIP": format!("10.77.{}.{}", i % 250, i % 251),
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-25T07:09:35Z"},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-25T07:09:35Z"}]}})
    }

    /// Every version reads back exactly as written, whichever dictionary it was compressed
    /// against, also after the dictionary has moved on.
    #[test]
    fn every_object_reads_back_as_written() {
        let mut packer = Packer::default();
        let pods = GroupResource::new("", "pods");
        let nodes = GroupResource::new("", "nodes");
        let kept: Vec<(Value, Json)> = (0..300)
            .map(|i| {
                let (gr, v) = if i % 5 == 0 {
                    (&nodes, json!({"kind": "Node", "metadata": {"name": i}}))
                } else {
                    (&pods, pod(i))
                };
                let j = packer.pack(gr, &v);
                (v, j)
            })
            .collect();
        for (v, j) in &kept {
            assert_eq!(&j.value(), v);
            assert_eq!(j.len(), serde_json::to_vec(v).unwrap().len());
            let mut out = b"[".to_vec();
            j.write_into(&mut out);
            assert_eq!(&out[1..], serde_json::to_vec(v).unwrap().as_slice(), "appended after what was there");
        }
    }

    /// The point of it: pods of a cluster keep a fraction of their JSON.
    #[test]
    fn pods_keep_a_fraction_of_their_json() {
        let mut packer = Packer::default();
        let pods = GroupResource::new("", "pods");
        let (mut raw, mut packed) = (0, 0);
        for i in 0..2000 {
            let j = packer.pack(&pods, &pod(i));
            if i >= 100 {
                raw += j.len();
                packed += j.packed_len();
            }
        }
        assert!(packed * 3 < raw, "{packed} bytes kept for {raw} of JSON");
    }

    #[test]
    fn small_or_incompressible_objects_are_kept_as_they_are() {
        let mut packer = Packer::default();
        let gr = GroupResource::new("", "configmaps");
        let tiny = json!({"a": 1});
        for _ in 0..4 {
            let j = packer.pack(&gr, &tiny);
            assert_eq!(j.packed_len(), j.len());
            assert_eq!(j.value(), tiny);
        }
        assert_eq!(Json::plain(b"{}".to_vec()).value(), json!({}));
    }
}
