//! A faithful in-process simulator of the External Voucher API.
