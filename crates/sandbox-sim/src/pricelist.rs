//! AWS's Price List Query API (`AWSPriceListService.GetProducts`), which LocalStack does not
//! emulate: the products a test gives, each an on-demand Linux, shared-tenancy EC2 instance type
//! of one region at one hourly price, answered as the API answers them (each item a JSON document
//! in a string, `terms.OnDemand.<sku>.<term>.priceDimensions.<rate>.pricePerUnit.USD`, the shape
//! of a real answer). A filter on any other attribute value matches nothing, as it would match
//! another product.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// The products the model serves: (region code, instance type) → USD an hour.
#[derive(Debug, Clone, Default)]
pub struct PriceList {
    /// (region code, instance type) → USD an hour.
    pub products: BTreeMap<(String, String), f64>,
}

/// The attributes every served product has besides its region and type.
const ATTRIBUTES: [(&str, &str); 6] = [
    ("operatingSystem", "Linux"),
    ("tenancy", "Shared"),
    ("preInstalledSw", "NA"),
    ("capacitystatus", "Used"),
    ("licenseModel", "No License required"),
    ("marketoption", "OnDemand"),
];

impl PriceList {
    /// The answer to a `GetProducts` request body, or the API's error (code, message).
    pub fn answer(&self, body: &str) -> Result<Value, (&'static str, String)> {
        let req: Value = serde_json::from_str(body).map_err(|e| ("SerializationException", e.to_string()))?;
        if req["ServiceCode"] != "AmazonEC2" {
            return Ok(json!({"FormatVersion": "aws_v1", "PriceList": []}));
        }
        let mut wanted = BTreeMap::new();
        for f in req["Filters"].as_array().into_iter().flatten() {
            if f["Type"] != "TERM_MATCH" {
                return Err(("InvalidParameterException", format!("unsupported filter type {}", f["Type"])));
            }
            let (Some(field), Some(value)) = (f["Field"].as_str(), f["Value"].as_str()) else {
                return Err(("InvalidParameterException", "a filter needs a Field and a Value".into()));
            };
            wanted.insert(field.to_string(), value.to_string());
        }
        let items: Vec<String> = self
            .products
            .iter()
            .filter(|((region, instance_type), _)| {
                let attrs = ATTRIBUTES.iter().map(|(k, v)| (*k, *v)).chain([
                    ("regionCode", region.as_str()),
                    ("instanceType", instance_type.as_str()),
                    ("servicecode", "AmazonEC2"),
                ]);
                let attrs: BTreeMap<&str, &str> = attrs.collect();
                wanted.iter().all(|(k, v)| attrs.get(k.as_str()) == Some(&v.as_str()))
            })
            .map(|((region, instance_type), usd)| item(region, instance_type, *usd).to_string())
            .collect();
        Ok(json!({"FormatVersion": "aws_v1", "PriceList": items}))
    }
}

/// One product as the API lists it.
fn item(region: &str, instance_type: &str, usd: f64) -> Value {
    let sku = format!("SKU{:X}", crate::naming::stable_hash(&[region, instance_type]) & 0xffff_ffff);
    let term = format!("{sku}.JRTCKXETXF");
    let rate = format!("{term}.6YS6EN2CT7");
    let mut attributes = json!({
        "instanceType": instance_type,
        "regionCode": region,
        "servicecode": "AmazonEC2",
        "usagetype": format!("BoxUsage:{instance_type}"),
    });
    for (k, v) in ATTRIBUTES {
        attributes[k] = json!(v);
    }
    json!({
        "product": {"productFamily": "Compute Instance", "attributes": attributes, "sku": sku},
        "serviceCode": "AmazonEC2",
        "terms": {"OnDemand": {term.clone(): {
            "offerTermCode": "JRTCKXETXF",
            "sku": sku,
            "priceDimensions": {rate: {
                "unit": "Hrs",
                "pricePerUnit": {"USD": format!("{usd:.10}")},
                "description": format!("${usd} per On Demand Linux {instance_type} Instance Hour"),
            }},
        }}},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(filters: &[(&str, &str)]) -> String {
        let filters: Vec<Value> =
            filters.iter().map(|(f, v)| json!({"Type": "TERM_MATCH", "Field": f, "Value": v})).collect();
        json!({"ServiceCode": "AmazonEC2", "Filters": filters, "FormatVersion": "aws_v1"}).to_string()
    }

    #[test]
    fn a_product_is_listed_only_for_filters_it_matches() {
        let list = PriceList { products: [(("us-west-2".into(), "m5.large".into()), 0.096)].into() };
        let one = list
            .answer(&request(&[
                ("regionCode", "us-west-2"),
                ("instanceType", "m5.large"),
                ("operatingSystem", "Linux"),
            ]))
            .unwrap();
        let items = one["PriceList"].as_array().unwrap();
        assert_eq!(items.len(), 1);
        let doc: Value = serde_json::from_str(items[0].as_str().unwrap()).unwrap();
        let dims = doc["terms"]["OnDemand"].as_object().unwrap().values().next().unwrap()["priceDimensions"].clone();
        let dim = dims.as_object().unwrap().values().next().unwrap();
        assert_eq!(dim["unit"], "Hrs");
        assert_eq!(dim["pricePerUnit"]["USD"], "0.0960000000");
        for other in [("operatingSystem", "Windows"), ("regionCode", "eu-west-1"), ("instanceType", "c5.large")] {
            let none = list.answer(&request(&[other])).unwrap();
            assert_eq!(none["PriceList"].as_array().unwrap().len(), 0, "{other:?}");
        }
    }
}
