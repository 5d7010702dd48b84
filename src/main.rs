//! The `voucher-cdc` command line; all behaviour lives in the library.

fn main() {
    println!("voucher-cdc");
}
