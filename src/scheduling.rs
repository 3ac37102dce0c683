//! What the Kubernetes scheduler decides, reproduced where the tool must predict it: whether a
//! pod tolerates a taint. Pure; the drain (`k8s::pods`) and the cleanup controllers' placement
//! (`cleanup::fits`) both ask it, so the two cannot disagree.

use k8s_openapi::api::core::v1::Toleration;

/// Kubernetes' toleration matching (`Toleration.ToleratesTaint`): the effect matches when the
/// toleration names none; an empty key with `Exists` matches every key; `Exists` matches any
/// value, `Equal` (the default) the same value.
pub(crate) fn tolerates(t: &Toleration, key: &str, effect: &str, value: &str) -> bool {
    let effect_ok = t.effect.as_deref().is_none_or(|e| e.is_empty() || e == effect);
    let exists = t.operator.as_deref() == Some("Exists");
    let key_ok = match t.key.as_deref() {
        None | Some("") => exists,
        Some(k) => k == key,
    };
    let value_ok = exists || t.value.as_deref().unwrap_or_default() == value;
    effect_ok && key_ok && value_ok
}
