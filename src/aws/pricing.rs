//! What an instance costs an hour, from AWS's own answers: the Price List Query API
//! (`pricing:GetProducts`) for on-demand Linux instances, `ec2:DescribeSpotPriceHistory` for spot
//! ones (the Price List has no spot prices). `sweep` shows it beside its verdicts; no price ever
//! changes a verdict, and a price AWS does not give is unknown, never guessed: the tool ships no
//! price table.

use std::collections::BTreeMap;

use serde_json::Value;

use super::AwsError;

/// The Price List API's endpoint region for instances of `region`, as Karpenter picks it
/// (`pkg/providers/pricing`, 1.0 to 1.14): the API is served from us-east-1, eu-central-1 and
/// ap-south-1 in the commercial partition and from cn-northwest-1 in China. `None` where the
/// partition has none (GovCloud, the ISO partitions).
pub(crate) fn price_list_region(region: &str) -> Option<&'static str> {
    match crate::partition::partition_of_region(region) {
        "aws" if region.starts_with("eu-") => Some("eu-central-1"),
        "aws" if region.starts_with("ap-") => Some("ap-south-1"),
        "aws" => Some("us-east-1"),
        "aws-cn" => Some("cn-northwest-1"),
        _ => None,
    }
}

/// The filters of one on-demand Linux, shared-tenancy price of `instance_type` in `region`:
/// Karpenter's (`fetchOnDemandPricing`) narrowed to one type and to the unlicensed product, so
/// that one product answers.
pub(crate) fn on_demand_filters(region: &str, instance_type: &str) -> Vec<(&'static str, String)> {
    vec![
        ("regionCode", region.to_string()),
        ("instanceType", instance_type.to_string()),
        ("operatingSystem", "Linux".into()),
        ("tenancy", "Shared".into()),
        ("preInstalledSw", "NA".into()),
        ("capacitystatus", "Used".into()),
        ("licenseModel", "No License required".into()),
        ("marketoption", "OnDemand".into()),
    ]
}

/// The hourly on-demand price in US dollars the Price List answered, each item a JSON document
/// (`terms.OnDemand.<sku>.<term>.priceDimensions.<rate>.pricePerUnit.USD`, unit `Hrs`). One
/// price, or why there is none: no item, an item without an hourly USD price, or items that
/// disagree (which one applies cannot be told).
pub(crate) fn on_demand_price(items: &[String]) -> Result<f64, String> {
    let mut prices = Vec::new();
    for item in items {
        let doc: Value = serde_json::from_str(item).map_err(|e| format!("a Price List item is not JSON: {e}"))?;
        let terms = doc.pointer("/terms/OnDemand").and_then(Value::as_object);
        let dimensions = terms.into_iter().flat_map(|t| t.values()).filter_map(|term| {
            term.get("priceDimensions").and_then(Value::as_object).map(|d| d.values().cloned().collect::<Vec<_>>())
        });
        for d in dimensions.flatten() {
            if d.get("unit").and_then(Value::as_str) != Some("Hrs") {
                continue;
            }
            let Some(usd) = d.pointer("/pricePerUnit/USD").and_then(Value::as_str) else { continue };
            match usd.parse::<f64>() {
                Ok(p) if p > 0.0 && p.is_finite() => prices.push(p),
                _ => {}
            }
        }
    }
    prices.sort_by(f64::total_cmp);
    prices.dedup();
    match prices.as_slice() {
        [] if items.is_empty() => Err("the Price List has no such product".into()),
        [] => Err("the Price List gives no hourly USD price".into()),
        [one] => Ok(*one),
        many => Err(format!("the Price List gives {} different prices", many.len())),
    }
}

/// The Price List client for one region's instances; `None` where the partition has no Price
/// List endpoint.
#[derive(Clone, Debug)]
pub struct Pricing {
    client: Option<aws_sdk_pricing::Client>,
    endpoint: String,
}

impl Pricing {
    pub(crate) fn new(client: Option<aws_sdk_pricing::Client>, endpoint: String) -> Pricing {
        Pricing { client, endpoint }
    }

    /// The hourly on-demand price of a Linux `instance_type` in `region`, or why it is unknown.
    pub(crate) async fn on_demand(&self, region: &str, instance_type: &str) -> Result<f64, Unpriced> {
        let Some(client) = &self.client else {
            return Err(Unpriced::Service(format!("no Price List endpoint serves {region}'s partition")));
        };
        let mut req = client.get_products().service_code("AmazonEC2").format_version("aws_v1").max_results(10);
        for (field, value) in on_demand_filters(region, instance_type) {
            let filter = aws_sdk_pricing::types::Filter::builder()
                .r#type(aws_sdk_pricing::types::FilterType::TermMatch)
                .field(field)
                .value(value)
                .build()
                .map_err(|e| Unpriced::Product(e.to_string()))?;
            req = req.filters(filter);
        }
        let out = req.send().await.map_err(|e| {
            let e = AwsError::from_sdk("pricing", "GetProducts", &self.endpoint, e);
            Unpriced::Service(if e.is_access_denied() {
                "pricing:GetProducts is not allowed (deploy/iam-policy-sweep.json grants it)".to_string()
            } else {
                e.to_string()
            })
        })?;
        // one product is asked for: more than a page of them is no single price either
        if out.next_token().is_some_and(|t| !t.is_empty()) {
            return Err(Unpriced::Product(format!(
                "the Price List lists more than {} products",
                out.price_list().len()
            )));
        }
        on_demand_price(out.price_list()).map_err(Unpriced::Product)
    }
}

/// Why a price is unknown: this product (no such product, no single price), or the service (it
/// refused or could not be reached: every other product would fail the same way, so it is not
/// asked again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unpriced {
    Product(String),
    Service(String),
}

impl Unpriced {
    pub(crate) fn why(&self) -> &str {
        match self {
            Unpriced::Product(w) | Unpriced::Service(w) => w,
        }
    }
}

/// The hourly spot prices EC2 answered, newest first per zone: the newest of each zone.
pub(crate) fn newest_by_zone(records: &[(String, i64, String)]) -> BTreeMap<String, f64> {
    let mut newest: BTreeMap<String, (i64, f64)> = BTreeMap::new();
    for (zone, at, price) in records {
        let Ok(p) = price.parse::<f64>() else { continue };
        if !(p > 0.0 && p.is_finite()) {
            continue;
        }
        let e = newest.entry(zone.clone()).or_insert((*at, p));
        if *at > e.0 {
            *e = (*at, p);
        }
    }
    newest.into_iter().map(|(z, (_, p))| (z, p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One item of a real `GetProducts` answer (m5.large, us-east-1), as the API sends it.
    const M5_LARGE: &str = r#"{"product":{"productFamily":"Compute Instance","attributes":{"instanceType":"m5.large","tenancy":"Shared","operatingSystem":"Linux","preInstalledSw":"NA","licenseModel":"No License required","capacitystatus":"Used","usagetype":"BoxUsage:m5.large"},"sku":"6C86BEPQVG73ZGGR"},"terms":{"OnDemand":{"6C86BEPQVG73ZGGR.JRTCKXETXF":{"offerTermCode":"JRTCKXETXF","priceDimensions":{"6C86BEPQVG73ZGGR.JRTCKXETXF.6YS6EN2CT7":{"unit":"Hrs","pricePerUnit":{"USD":"0.0960000000"},"description":"$0.096 per On Demand Linux m5.large Instance Hour"}}}}}}"#;

    #[test]
    fn the_price_list_is_asked_where_aws_serves_it() {
        assert_eq!(price_list_region("us-west-2"), Some("us-east-1"));
        assert_eq!(price_list_region("sa-east-1"), Some("us-east-1"));
        assert_eq!(price_list_region("eu-west-3"), Some("eu-central-1"));
        assert_eq!(price_list_region("ap-northeast-1"), Some("ap-south-1"));
        assert_eq!(price_list_region("cn-north-1"), Some("cn-northwest-1"));
        assert_eq!(price_list_region("us-gov-west-1"), None);
        assert_eq!(price_list_region("us-iso-east-1"), None);
    }

    #[test]
    fn one_hourly_usd_price_or_why_not() {
        assert_eq!(on_demand_price(&[M5_LARGE.to_string()]), Ok(0.096));
        // the same product twice (pages overlap) is still one price
        assert_eq!(on_demand_price(&[M5_LARGE.to_string(), M5_LARGE.to_string()]), Ok(0.096));
        assert!(on_demand_price(&[]).unwrap_err().contains("no such product"));
        let other = M5_LARGE.replace("0.0960000000", "0.1070000000");
        assert!(on_demand_price(&[M5_LARGE.to_string(), other]).unwrap_err().contains("2 different prices"));
        let monthly = M5_LARGE.replace("\"Hrs\"", "\"Quantity\"");
        assert!(on_demand_price(&[monthly]).unwrap_err().contains("no hourly USD price"));
        let free = M5_LARGE.replace("0.0960000000", "0.0000000000");
        assert!(on_demand_price(&[free]).is_err(), "a zero price is no price");
        assert!(on_demand_price(&["not json".into()]).is_err());
    }

    #[test]
    fn the_newest_spot_price_of_each_zone() {
        let records = vec![
            ("us-west-2a".to_string(), 100, "0.0400".to_string()),
            ("us-west-2a".to_string(), 200, "0.0380".to_string()),
            ("us-west-2b".to_string(), 150, "0.0410".to_string()),
            ("us-west-2c".to_string(), 150, "n/a".to_string()),
        ];
        let newest = newest_by_zone(&records);
        assert_eq!(newest.len(), 2);
        assert_eq!(newest["us-west-2a"], 0.038);
        assert_eq!(newest["us-west-2b"], 0.041);
    }
}
