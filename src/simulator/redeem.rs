//! Redemption rules for purchased vouchers, free of I/O: full and part
//! redemption per `allow_part_redeem`, refusals for void, expired and
//! already-redeemed vouchers and for amounts the balance cannot cover.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use serde_json::Value;

use super::data::{self, Purchased};
use super::model::{Actor, RedemptionResult, RedemptionTenant, RedemptionVoucher};
use crate::stream::TenantId;

/// A refused redemption: the field to blame and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Field name for the ValidationError `errors` object.
    pub field: &'static str,
    /// One-line cause.
    pub message: String,
}

fn refuse(field: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        field,
        message: message.into(),
    }
}

/// Which purchased voucher a body names.
#[derive(Debug, Clone, PartialEq)]
pub struct RedeemBody {
    /// `redemption_token`, when given.
    pub redemption_token: Option<String>,
    /// `voucher_id`, when given.
    pub voucher_id: Option<i64>,
    /// `amount` in major units, when given.
    pub amount: Option<f64>,
    /// Which field identifies the voucher, for error messages.
    pub identified_by: &'static str,
}

/// Validates the JSON shape of a redeem body, collecting every field error.
pub fn parse_body(body: &[u8]) -> Result<RedeemBody, BTreeMap<String, Vec<String>>> {
    let mut errors: BTreeMap<String, Vec<String>> = BTreeMap::new();
    fn add(errors: &mut BTreeMap<String, Vec<String>>, field: &str, message: String) {
        errors.entry(field.to_string()).or_default().push(message);
    }
    let value: Value = match serde_json::from_slice(body) {
        Ok(value) => value,
        Err(e) => {
            add(&mut errors, "body", format!("body is not valid JSON: {e}"));
            return Err(errors);
        }
    };
    let Some(object) = value.as_object() else {
        add(
            &mut errors,
            "body",
            "body must be a JSON object".to_string(),
        );
        return Err(errors);
    };
    let mut parsed = RedeemBody {
        redemption_token: None,
        voucher_id: None,
        amount: None,
        identified_by: "voucher_id",
    };
    for (key, value) in object {
        match key.as_str() {
            "redemption_token" => match value {
                Value::Null => {}
                Value::String(s) if !s.trim().is_empty() => parsed.redemption_token = Some(s.clone()),
                _ => add(&mut errors, key, "redemption_token must be a non-empty string".to_string()),
            },
            "voucher_id" => match value {
                Value::Null => {}
                Value::Number(n) if n.as_i64().is_some_and(|id| id > 0) => parsed.voucher_id = n.as_i64(),
                _ => add(&mut errors, key, "voucher_id must be a positive integer".to_string()),
            },
            "amount" => match value {
                Value::Null => {}
                Value::Number(n) => match n.as_f64() {
                    Some(a) if a > 0.0 && a.is_finite() && ((a * 100.0).round() - a * 100.0).abs() < 1e-6 => {
                        parsed.amount = Some(a)
                    }
                    _ => add(&mut errors, key, "amount must be a positive number in major units with at most 2 decimals".to_string()),
                },
                _ => add(&mut errors, key, "amount must be a number in major units".to_string()),
            },
            other => add(
                &mut errors,
                other,
                format!("unknown field `{other}`; valid options are redemption_token, voucher_id, amount"),
            ),
        }
    }
    if parsed.redemption_token.is_none() && parsed.voucher_id.is_none() && errors.is_empty() {
        add(
            &mut errors,
            "voucher_id",
            "either redemption_token or voucher_id is required".to_string(),
        );
    }
    if parsed.redemption_token.is_some() {
        parsed.identified_by = "redemption_token";
    }
    if errors.is_empty() {
        Ok(parsed)
    } else {
        Err(errors)
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Whether a purchased voucher is past its validity on `today`.
pub fn is_expired(purchased: &Purchased, today: NaiveDate) -> bool {
    today > purchased.date_valid_end
}

/// The voucher object of a redemption result for the voucher's current state.
pub fn voucher_view(p: &Purchased, today: NaiveDate) -> RedemptionVoucher {
    let (status, reason, redemption_status) = if p.void {
        ("not_redeemable", "void", "unredeemed")
    } else if p.redeemed || p.current_balance <= 0.0 {
        ("redeemed", "fully_redeemed", "fully_redeemed")
    } else if is_expired(p, today) {
        ("not_redeemable", "expired", "unredeemed")
    } else if p.current_balance < p.initial_balance {
        ("redeemable", "none", "part_redeemed")
    } else {
        ("redeemable", "none", "unredeemed")
    };
    RedemptionVoucher {
        id: p.id,
        reference: Some(p.reference.clone()),
        current_balance: Some(p.current_balance),
        initial_balance: Some(p.initial_balance),
        currency: Some(p.currency.clone()),
        is_monetary: Some(p.is_monetary),
        allow_part_redeem: Some(p.allow_part_redeem),
        status: Some(status.to_string()),
        reason_code: Some(reason.to_string()),
        product_title: Some(p.product_title.clone()),
        recipient_name: Some(p.recipient_name.clone()),
        customer_name: Some(p.customer_name.clone()),
        redemption_status: Some(redemption_status.to_string()),
        void: Some(p.void),
        date_valid_start: Some(p.date_valid_start),
        date_valid_end: Some(p.date_valid_end),
    }
}

/// Applies a redemption to a purchased voucher, or refuses it.
pub fn redeem(
    p: &mut Purchased,
    body: &RedeemBody,
    tenant: TenantId,
    now: DateTime<Utc>,
) -> Result<RedemptionResult, Refusal> {
    let field = body.identified_by;
    if p.void {
        return Err(refuse(field, format!("voucher {} is void", p.reference)));
    }
    if p.redeemed || p.current_balance <= 0.0 {
        return Err(refuse(
            field,
            format!("voucher {} is already fully redeemed", p.reference),
        ));
    }
    if is_expired(p, now.date_naive()) {
        return Err(refuse(
            field,
            format!("voucher {} expired on {}", p.reference, p.date_valid_end),
        ));
    }
    let amount =
        match (p.is_monetary, body.amount) {
            (false, Some(_)) => return Err(refuse(
                "amount",
                "amount is not accepted for a non-monetary voucher; omit it to redeem the voucher",
            )),
            (false, None) | (true, None) => p.current_balance,
            (true, Some(amount)) => amount,
        };
    if amount > p.current_balance + 1e-9 {
        return Err(refuse(
            "amount",
            format!(
                "insufficient balance: {amount:.2} requested, {:.2} {} available",
                p.current_balance, p.currency
            ),
        ));
    }
    let full = (p.current_balance - amount).abs() < 1e-9;
    if !full && !p.allow_part_redeem {
        return Err(refuse(
            "amount",
            format!(
                "part redemption is not allowed for this voucher; redeem the full balance of {:.2}",
                p.current_balance
            ),
        ));
    }
    p.current_balance = if full {
        0.0
    } else {
        round2(p.current_balance - amount)
    };
    if full {
        p.redeemed = true;
    }
    let name = data::tenant_name(tenant);
    Ok(RedemptionResult {
        status: "redeemed".to_string(),
        reason_code: Some(
            if full {
                "full_redemption"
            } else {
                "part_redemption"
            }
            .to_string(),
        ),
        voucher: voucher_view(p, now.date_naive()),
        tenant: RedemptionTenant {
            id: i64::try_from(tenant).unwrap_or(i64::MAX),
            name: Some(name.clone()),
            kind: Some("merchant".to_string()),
            source_tenant_id: Some(i64::try_from(tenant).unwrap_or(i64::MAX)),
            source_tenant_name: Some(name),
            source_tenant_type: Some("merchant".to_string()),
        },
        redeemed_at: Some(now),
        actor: Some(Actor {
            id: 1,
            name: "External API".to_string(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voucher(monetary: bool, part: bool, balance: f64) -> Purchased {
        Purchased {
            id: 1,
            reference: "T1-ABC".into(),
            current_balance: balance,
            initial_balance: balance,
            currency: "GBP".into(),
            is_monetary: monetary,
            allow_part_redeem: part,
            void: false,
            redeemed: false,
            product_title: "Gift".into(),
            recipient_name: "A".into(),
            customer_name: "B".into(),
            date_valid_start: NaiveDate::from_ymd_opt(2024, 1, 1).unwrap(),
            date_valid_end: NaiveDate::from_ymd_opt(2035, 1, 1).unwrap(),
        }
    }

    fn body(amount: Option<f64>) -> RedeemBody {
        RedeemBody {
            redemption_token: None,
            voucher_id: Some(1),
            amount,
            identified_by: "voucher_id",
        }
    }

    #[test]
    fn part_redemptions_reduce_the_balance_until_it_is_spent() {
        let mut v = voucher(true, true, 50.0);
        let r = redeem(&mut v, &body(Some(20.5)), 1, Utc::now()).unwrap();
        assert_eq!(r.voucher.current_balance, Some(29.5));
        assert_eq!(r.reason_code.as_deref(), Some("part_redemption"));
        assert_eq!(
            r.voucher.redemption_status.as_deref(),
            Some("part_redeemed")
        );
        let err = redeem(&mut v, &body(Some(30.0)), 1, Utc::now()).unwrap_err();
        assert_eq!(err.field, "amount");
        assert!(err.message.contains("insufficient balance"));
        let r = redeem(&mut v, &body(None), 1, Utc::now()).unwrap();
        assert_eq!(r.voucher.current_balance, Some(0.0));
        let err = redeem(&mut v, &body(None), 1, Utc::now()).unwrap_err();
        assert!(err.message.contains("already fully redeemed"));
    }

    #[test]
    fn a_voucher_without_part_redeem_only_takes_its_full_balance() {
        let mut v = voucher(true, false, 50.0);
        assert!(redeem(&mut v, &body(Some(10.0)), 1, Utc::now())
            .unwrap_err()
            .message
            .contains("part redemption is not allowed"));
        assert!(redeem(&mut v, &body(Some(50.0)), 1, Utc::now()).is_ok());
    }

    #[test]
    fn void_expired_and_experience_amounts_are_refused() {
        let mut v = voucher(true, true, 50.0);
        v.void = true;
        assert!(redeem(&mut v, &body(None), 1, Utc::now())
            .unwrap_err()
            .message
            .contains("void"));
        let mut v = voucher(true, true, 50.0);
        v.date_valid_end = NaiveDate::from_ymd_opt(2020, 1, 1).unwrap();
        assert!(redeem(&mut v, &body(None), 1, Utc::now())
            .unwrap_err()
            .message
            .contains("expired"));
        let mut v = voucher(false, false, 1.0);
        assert_eq!(
            redeem(&mut v, &body(Some(1.0)), 1, Utc::now())
                .unwrap_err()
                .field,
            "amount"
        );
        assert!(redeem(&mut v, &body(None), 1, Utc::now()).is_ok());
    }

    #[test]
    fn malformed_bodies_name_each_bad_field() {
        assert!(parse_body(b"{").unwrap_err().contains_key("body"));
        assert!(parse_body(b"[]").unwrap_err().contains_key("body"));
        assert!(parse_body(b"{}").unwrap_err().contains_key("voucher_id"));
        let errors = parse_body(br#"{"voucher_id":"x","amount":-1,"colour":1}"#).unwrap_err();
        assert_eq!(errors.len(), 3);
        assert!(parse_body(br#"{"voucher_id":3,"amount":1.005}"#)
            .unwrap_err()
            .contains_key("amount"));
        let ok = parse_body(br#"{"redemption_token":"rt","amount":12.5}"#).unwrap();
        assert_eq!(ok.identified_by, "redemption_token");
    }
}
